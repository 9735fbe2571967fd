"""``RolloutController``: the rollout loop in a background thread of trainer rank 0.

The trainer thread calls plain blocking methods; each is carried onto the controller's event
loop (``run_coroutine_threadsafe``), so all rollout state is only ever touched by that loop and
a ``state_dict`` is a consistent snapshot. Typical step::

    batch = ctl.get_batch(timeout=600)        # B groups, oldest admissible first
    ...train...
    ctl.pause_generation()                     # servers return in-flight requests partial
    ...push weights to the servers as version v + 1...
    ctl.resume_generation(v + 1)               # interrupted samples continue under v + 1

With ``eta = 0`` the gate admits exactly one batch per version, so the same calls give
synchronous RL: the whole batch is generated, then trained, then the next one starts.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.loop import RolloutError, RolloutLoop
from megatron_areal.rollout.sources import PromptLike, PromptSourceLike, ScorerLike
from megatron_areal.rollout.staleness import StalenessGate
from megatron_areal.rollout.trajectory import Trajectory

__all__ = ["RolloutController", "RolloutError"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Control calls (pause, continue) wait on servers; beyond this the trainer gets an error.
CONTROL_TIMEOUT_S = 300.0


class RolloutController:
    def __init__(self, rollout: RolloutConfig, staleness: StalenessConfig, server_urls: list[str],
                 prompts: PromptSourceLike, encode: Callable[[PromptLike], list[int]],
                 decode: Callable[[list[int]], str], scorer: ScorerLike, *, api_key: str | None = None,
                 version: int = 0) -> None:
        if not staleness.overlap and staleness.eta != 0:
            raise ValueError("staleness.overlap = false (synchronous mode) requires staleness.eta = 0")
        self._core = RolloutLoop(rollout, staleness.eta, server_urls, prompts, encode, decode, scorer,
                                 api_key=api_key, version=version)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def gate(self) -> StalenessGate:
        return self._core.gate

    @property
    def version(self) -> int:
        return self._core.version

    # ----- lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("RolloutController already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-controller", daemon=True)
        self._thread.start()
        self._call(self._core.start(), CONTROL_TIMEOUT_S)
        log.info("rollout controller started: %d servers, batch %d groups x %d samples, eta %d, version %d",
                 len(self._core.server_urls), self._core.cfg.batch_size, self._core.cfg.group_size,
                 self._core.eta, self._core.version)

    def stop(self) -> None:
        """Cancel generation (in-flight work is abandoned; a saved state re-queues it) and join."""
        if self._thread is None:
            return
        try:
            self._call(self._core.close(), CONTROL_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._thread = self._loop = None

    def __enter__(self) -> RolloutController:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("RolloutController is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _run_sync(self, fn: Callable[[], T], need_loop: bool = False) -> T:
        """Run ``fn`` on the loop, or directly when the loop is not running (unless ``need_loop``)."""
        if self._loop is None:
            if need_loop:
                raise RuntimeError("RolloutController is not running; call start() first")
            return fn()

        async def call() -> T:
            return fn()
        return self._call(call(), CONTROL_TIMEOUT_S)

    # ----- the trainer's API

    def get_batch(self, timeout: float) -> list[Trajectory]:
        """``batch_size`` groups (``batch_size * group_size`` trajectories, grouped), each at most
        ``eta`` versions old. Blocks; raises ``RolloutError`` saying what is missing on timeout."""
        return self._call(self._core.take_batch(timeout), timeout + CONTROL_TIMEOUT_S)

    def pause_generation(self, pause_servers: bool = True) -> None:
        """Hold new groups and the re-posting of interrupted samples; with ``pause_servers`` also
        pause every server (abort mode: in-flight requests return with the tokens they have).
        Pass False when the weight mover pauses the servers itself."""
        self._call(self._core.pause(pause_servers), CONTROL_TIMEOUT_S)

    def resume_generation(self, new_version: int, resume_servers: bool = True) -> None:
        """Publish ``new_version`` (the servers already hold it) and continue generating."""
        self._call(self._core.resume(new_version, resume_servers), CONTROL_TIMEOUT_S)

    def drop_server(self, url: str, reason: str) -> None:
        """Route nothing more to ``url`` (the weight path dropped it); safe from any thread."""
        self._run_sync(lambda: self._core.drop_server(url, reason), need_loop=True)

    def add_server(self, url: str) -> None:
        """Route to ``url`` again (the weight path re-admitted it with the current weights); safe
        from any thread."""
        self._run_sync(lambda: self._core.add_server(url), need_loop=True)

    def set_version(self, version: int) -> None:
        self._run_sync(lambda: self._core.set_version(version))

    def metrics(self) -> dict[str, float]:
        return self._run_sync(self._core.metrics, need_loop=True)

    def state_dict(self) -> dict[str, Any]:
        return self._run_sync(self._core.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before ``start()``: version, buffer, gate counts, dataset position; the prompts
        that were in flight at save time come out of the dataset again first."""
        if self._thread is not None:
            raise RolloutError("load_state_dict must be called before start()")
        self._core.load_state_dict(state)
