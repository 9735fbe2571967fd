"""One thread that runs the server's weight operations one at a time, in arrival order.

SGLang's scheduler runs group joins, broadcasts, loads and begin/end inline, so they queue FIFO
across every group and never overlap. Running them here, not on asyncio's default executor, also
keeps a join that hangs (an unreachable trainer) from starving the endpoints that do use that
executor: pause, continue and abort must answer while a join waits out its timeout. The thread
is a daemon so that a stuck join never holds up the server's shutdown.
"""
from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any


class WeightQueue:
    """A daemon thread that runs queued weight operations one at a time, in arrival order."""

    def __init__(self, name: str = "weight-updates") -> None:
        self._jobs: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]]] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Queue ``fn(*args, **kwargs)`` behind every operation that arrived before it; await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((loop, future, functools.partial(fn, *args, **kwargs)))
        return await future

    def _run(self) -> None:
        while True:
            loop, future, job = self._jobs.get()
            try:
                outcome: tuple[Any, BaseException | None] = (job(), None)
            except Exception as e:  # handed to the awaiting handler, which turns it into a reply
                outcome = (None, e)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                return


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
