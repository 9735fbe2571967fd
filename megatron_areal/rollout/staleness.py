"""The staleness gate: counts of rollouts in each state and the admission rule over them.

Unit: one *rollout* is one group, i.e. the ``group_size`` samples of one prompt; ``batch_size``
counts groups and so do ``running``, ``accepted`` and ``max_concurrent``. A group is admitted,
finished, scored and trained as a whole, so the gate never sees half a group.

States and transitions (each a named method; anything that would make a count negative or move
the version backwards raises ``GateError`` instead of being absorbed):

- ``on_submit``  a new group starts: ``running += 1``; only allowed while ``capacity() >= 1``.
- ``on_accept``  it finished and entered the replay buffer: ``running -= 1, accepted += 1``.
- ``on_reject``  it finished without entering the buffer (filtered, failed): ``running -= 1``.
- ``on_drop``    an accepted group was found too stale to train and removed: ``accepted -= 1``,
                 which frees its slot so a fresh group can replace it.
- ``on_version`` the trainer published new weights.

In-flight groups are not part of a saved state: a restore hands their prompts back to the
dataset, so a restored gate starts with ``running = 0``.

``accepted`` therefore counts groups trained so far plus those waiting in the buffer, which is
what the capacity formula needs (docs/design.md, "Staleness gate").
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from megatron_areal.algorithm import staleness_capacity

GateListener = Callable[[str, "GateCounts", int], None]


class GateError(RuntimeError):
    """An impossible transition of the staleness gate (a bookkeeping bug, never user error)."""


@dataclass
class GateCounts:
    """The gate's counts of groups at one moment (``running`` in flight, ``accepted`` finished and not yet
    trained)."""

    version: int = 0
    running: int = 0
    accepted: int = 0
    submitted: int = 0  # cumulative, for metrics
    rejected: int = 0
    dropped: int = 0


class StalenessGate:
    """Thread-safe counts of groups plus the admission rule ``staleness_capacity``."""

    def __init__(self, eta: int, batch_size: int, max_concurrent: int, version: int = 0) -> None:
        staleness_capacity(eta, version, batch_size, 0, 0, max_concurrent)  # raises on what the rule refuses
        self.eta = eta
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self._c = GateCounts(version=version)
        self._lock = threading.Lock()
        self._listeners: list[GateListener] = []

    def add_listener(self, fn: GateListener) -> None:
        """``fn(event, counts_after, capacity_before)`` on every transition (tests, tracing)."""
        self._listeners.append(fn)

    # ----- queries

    def counts(self) -> GateCounts:
        """A copy of the counts."""
        with self._lock:
            return GateCounts(**asdict(self._c))

    @property
    def version(self) -> int:
        """The current policy version."""
        return self._c.version

    def capacity(self) -> int:
        """How many more groups may start now (``staleness_capacity``)."""
        with self._lock:
            return self._capacity()

    def _capacity(self) -> int:
        c = self._c
        return staleness_capacity(eta=self.eta, version=c.version, batch_size=self.batch_size,
                                  accepted=c.accepted, running=c.running,
                                  max_concurrent=self.max_concurrent)

    # ----- transitions

    def try_submit(self) -> bool:
        """Atomically: if a group may start now, count it as running and return True."""
        with self._lock:
            if self._capacity() < 1:
                return False
            self._apply("submit", running=1, submitted=1)
            return True

    def on_submit(self) -> None:
        """A group started; raises ``GateError`` if there was no capacity for it."""
        with self._lock:
            if self._capacity() < 1:
                raise GateError(f"submit without capacity: {self._c}")
            self._apply("submit", running=1, submitted=1)

    def on_accept(self) -> None:
        """A running group finished and went into the buffer."""
        with self._lock:
            self._apply("accept", running=-1, accepted=1)

    def on_reject(self) -> None:
        """A running group finished without entering the buffer (filtered, failed)."""
        with self._lock:
            self._apply("reject", running=-1, rejected=1)

    def on_drop(self, n: int = 1) -> None:
        """``n`` accepted groups were found too stale to train and removed from the buffer."""
        with self._lock:
            self._apply("drop", accepted=-n, dropped=n)

    def on_version(self, version: int) -> None:
        """The policy moved to ``version`` (never backwards)."""
        with self._lock:
            if version < self._c.version:
                raise GateError(f"version moved backwards: {self._c.version} -> {version}")
            cap = self._capacity()
            self._c.version = version
            self._notify("version", cap)

    def _apply(self, event: str, **delta: int) -> None:
        cap = self._capacity()
        new = GateCounts(**asdict(self._c))
        for key, d in delta.items():
            setattr(new, key, getattr(new, key) + d)
        bad = [k for k, v in asdict(new).items() if v < 0]
        if bad:
            raise GateError(f"'{event}' would make {', '.join(bad)} negative: {self._c} + {delta}")
        self._c = new
        self._notify(event, cap)

    def _notify(self, event: str, capacity_before: int) -> None:
        snapshot = GateCounts(**asdict(self._c))
        for fn in self._listeners:
            fn(event, snapshot, capacity_before)

    # ----- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Counts to restore; in-flight groups are re-queued on restore, so ``running`` is not kept."""
        with self._lock:
            state = asdict(self._c)
        state.pop("running")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts saved by ``state_dict``; only while no group is running."""
        with self._lock:
            if self._c.running:
                raise GateError(f"load_state_dict while {self._c.running} groups are running")
            restored = GateCounts(running=0, **state)
            if min(asdict(restored).values()) < 0:
                raise GateError(f"negative count in restored gate state {state}")
            self._c = restored
