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
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from megatron_areal.fleet.fleet import Fleet
from megatron_areal.records import Trajectory
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.loop import RolloutError, RolloutLoop
from megatron_areal.rollout.sources import EpisodesLike, PromptLike, PromptSourceLike, ScorerLike
from megatron_areal.rollout.staleness import StalenessGate

__all__ = ["RolloutController", "RolloutError"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Control calls (pause, continue) wait on servers; beyond this the trainer gets an error.
CONTROL_TIMEOUT_S = 300.0


class RolloutController:
    """Rollouts on ``servers``: trainer rank 0's shared ``Fleet`` (the weight path drops and re-admits
    its members), or a list of URLs, for which the controller holds a fleet of its own from
    ``start`` to ``stop``. The core runs on the fleet's event loop."""

    def __init__(self, rollout: RolloutConfig, staleness: StalenessConfig, servers: Fleet | list[str],
                 prompts: PromptSourceLike, encode: Callable[[PromptLike], list[int]],
                 decode: Callable[[list[int]], str], scorer: ScorerLike, *, api_key: str | None = None,
                 version: int = 0, episodes: EpisodesLike | None = None) -> None:
        staleness.validate()  # the one check of eta (a section built in code has not been through load_config)
        if not (servers.urls if isinstance(servers, Fleet) else servers):
            raise ValueError("RolloutController: no rollout server URLs given")
        self._core = RolloutLoop(rollout, staleness.eta, prompts, encode, decode, scorer, version=version,
                                 episodes=episodes)
        self._servers, self._api_key = servers, api_key
        self._fleet: Fleet | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def gate(self) -> StalenessGate:
        """The staleness gate: counts of running and accepted groups, and the capacity rule."""
        return self._core.gate

    @property
    def version(self) -> int:
        """The policy version new groups start at."""
        return self._core.version

    # ----- lifecycle

    def start(self) -> None:
        """Open the fleet (unless it is shared) and start generating on its event loop."""
        if self._loop is not None:
            raise RuntimeError("RolloutController already started")
        servers = self._servers
        self._fleet = servers if isinstance(servers, Fleet) else Fleet(
            servers, api_key=self._api_key, request_timeout_s=self._core.cfg.request_timeout_s)
        self._loop = self._fleet.loop
        self._call(self._core.start(self._fleet.routing), CONTROL_TIMEOUT_S)
        log.info("rollout controller started: %d servers, batch %d groups x %d samples, eta %d, version %d",
                 len(self._fleet.urls), self._core.cfg.batch_size, self._core.cfg.group_size,
                 self._core.eta, self._core.version)

    def stop(self) -> None:
        """Cancel generation (in-flight work is abandoned; a saved state re-queues it); a fleet of
        the controller's own is closed, a shared one stays open."""
        if self._loop is None:
            return
        try:
            self._call(self._core.close(), CONTROL_TIMEOUT_S)
        finally:
            if self._fleet is not self._servers:
                self._fleet.close()
            self._fleet = self._loop = None

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
        """``batch_size`` groups (``batch_size * group_size`` trajectories, grouped; more where an agent
        episode became several, ``Trajectory.episode``), each at most ``eta`` versions old. Blocks; raises
        ``RolloutError`` saying what is missing on timeout."""
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
        """Route nothing more to ``url`` (``Fleet.drop``); from any thread but the fleet's loop."""
        self._running_fleet().drop(url, reason)

    def _running_fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("RolloutController is not running; call start() first")
        return self._fleet

    def set_version(self, version: int) -> None:
        """Set the policy version without pausing (a restored run before ``start``, or tests)."""
        self._run_sync(lambda: self._core.set_version(version))

    def metrics(self) -> dict[str, float]:
        """Rollout figures since the last call (throughput, staleness, gate counts, buffer)."""
        return self._run_sync(self._core.metrics, need_loop=True)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side: version, buffer, gate counts, dataset position."""
        return self._run_sync(self._core.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before ``start()``: version, buffer, gate counts, dataset position; the prompts
        that were in flight at save time come out of the dataset again first."""
        if self._loop is not None:
            raise RolloutError("load_state_dict must be called before start()")
        self._core.load_state_dict(state)
