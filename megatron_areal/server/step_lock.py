"""The lock between the model runner's steps and the control operations that act between them.

A plain ``threading.Lock`` is not fair: the runner releases it after a step and takes it again at
once, so a control operation waiting for it (pause, abort, a weight update) could wait until the
engine ran out of work. Control operations take ``StepLock`` as an ordinary lock and count
themselves while they wait; the runner takes it with ``for_step()``, which first lets every waiting
control operation go.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepLock:
    """A lock that control operations take as usual and the model runner takes with ``for_step()``, after them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self._none_waiting = threading.Condition(threading.Lock())

    def acquire(self, timeout: float = -1) -> bool:
        """Take the lock as a control operation (counted as waiting, so the runner lets it go first)."""
        with self._none_waiting:
            self._waiting += 1
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            with self._none_waiting:
                self._waiting -= 1
                if not self._waiting:
                    self._none_waiting.notify_all()

    def release(self) -> None:
        """Release the lock."""
        self._lock.release()

    def __enter__(self) -> StepLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextmanager
    def for_step(self) -> Iterator[None]:
        """Held for one runner step, taken only once no control operation is waiting for it."""
        with self._none_waiting:
            self._none_waiting.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield
