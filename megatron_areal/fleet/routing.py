"""The members of a ``Fleet`` as the controller routes over them: health, in-flight load and busy
time per server (``Fleet.routing``).

Load is the number of our own requests in flight on a server, counted here rather than polled
from ``/v1/loads``: every request passes through this pool, so the count is exact and costs no
round trip. A server that fails a request is marked down at once (one log line naming it) and
gets no new work until it answers a health probe again with the current weights.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.wakeup import Signal
from megatron_areal.rundir import timeline

log = logging.getLogger(__name__)


MAX_STRIKES = 3


class NoHealthyServer(RuntimeError):
    """Every server of the fleet is down."""


@dataclass
class ServerSlot:
    """One server in the pool: its client, whether requests go to it, and its request counts and busy time."""

    client: RolloutClient
    healthy: bool = True
    inflight: int = 0
    requests: int = 0  # cumulative, routed here
    failures: int = 0
    # Times in a row it went down again without serving one request since it last came back; at
    # MAX_STRIKES it is removed (a server that answers its health probe but fails every request).
    strikes: int = 0
    served_since_down: bool = False
    busy_s: float = 0.0  # time with at least one request in flight, up to busy_since
    busy_since: float | None = None
    last_error: str = field(default="")

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.client.url


class ServerPool:
    """Least-loaded routing over healthy servers; not thread-safe (lives on the fleet's loop)."""

    def __init__(self, clients: list[RolloutClient], clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = [ServerSlot(client=c) for c in clients]
        self.removed = 0  # members removed for good (the weight path dropped them)
        self.added = 0  # servers (re-)admitted after the start
        self._clock = clock
        self._changed = Signal()

    # ----- routing

    def healthy(self) -> list[ServerSlot]:
        """The servers requests may go to."""
        return [s for s in self.slots if s.healthy]

    def down_urls(self) -> list[str]:
        """URLs of the servers marked down."""
        return [s.url for s in self.slots if not s.healthy]

    def pick(self) -> ServerSlot:
        """The healthy server with the fewest of our requests in flight (lowest index on ties)."""
        candidates = self.healthy()
        if not candidates:
            raise NoHealthyServer(f"all {len(self.slots)} rollout servers are down: "
                                  + "; ".join(f"{s.url} ({s.last_error})" for s in self.slots))
        return min(candidates, key=lambda s: s.inflight)

    async def wait_healthy(self) -> None:
        """Return once at least one server is up (the health probe revives them)."""
        while not self.healthy():
            await self._changed.wait()

    def begin(self, slot: ServerSlot) -> None:
        """Count a request sent to ``slot`` (its busy time starts with the first)."""
        if slot.inflight == 0:
            slot.busy_since = self._clock()
        timeline.enter(timeline.server_role(slot.url), "generating")
        slot.inflight += 1
        slot.requests += 1

    def end(self, slot: ServerSlot) -> None:
        """Count a request of ``slot`` finished; an unmatched end is a bug and raises."""
        if slot.inflight <= 0:
            raise RuntimeError(f"{slot.url}: request finished that was never started")
        slot.inflight -= 1
        timeline.leave(timeline.server_role(slot.url), "generating")
        if slot.inflight == 0 and slot.busy_since is not None:
            slot.busy_s += self._clock() - slot.busy_since
            slot.busy_since = None

    # ----- health

    def succeeded(self, slot: ServerSlot) -> None:
        """A request on ``slot`` was answered well: its strikes are forgiven."""
        slot.served_since_down = True
        slot.strikes = 0

    def mark_down(self, slot: ServerSlot, reason: str) -> None:
        """Route nothing more to ``slot`` until the health probe revives it (``reason`` is logged once).

        Going down ``MAX_STRIKES`` times in a row without answering one request well in between
        removes it from the pool for good.
        """
        slot.failures += 1
        slot.last_error = reason
        if slot.healthy:
            slot.healthy = False
            slot.strikes = 1 if slot.served_since_down else slot.strikes + 1
            slot.served_since_down = False
            log.error("rollout server %s marked unhealthy, its requests go to the other servers: %s",
                      slot.url, reason)
            self._notify()
            if slot.strikes >= MAX_STRIKES:
                self.remove(slot.url, f"failed {slot.strikes} times in a row, each time after it came back, "
                                      f"without answering a request well: {reason}")

    def mark_up(self, slot: ServerSlot) -> None:
        """Route to ``slot`` again."""
        if not slot.healthy:
            slot.healthy = True
            log.warning("rollout server %s is healthy again", slot.url)
            self._notify()

    def remove(self, url: str, reason: str) -> None:
        """Stop routing to ``url`` for good (the weight path dropped it: it will never get new
        weights). Requests already on it finish or fail on their own."""
        for slot in [s for s in self.slots if s.url == url.rstrip("/")]:
            self.mark_down(slot, reason)
            self.slots.remove(slot)
            self.removed += 1
            log.error("rollout server %s removed from the fleet: %s", slot.url, reason)

    def add(self, client: RolloutClient) -> ServerSlot:
        """Route to ``client``'s server (again): the weight path re-admitted it with the current
        weights. A slot already there for its url is marked up instead."""
        self.added += 1
        for slot in self.slots:
            if slot.url == client.url:
                self.mark_up(slot)
                return slot
        slot = ServerSlot(client=client)
        self.slots.append(slot)
        log.warning("rollout server %s added to the fleet (%d servers)", slot.url, len(self.slots))
        self._notify()
        return slot

    async def probe_down(self) -> list[ServerSlot]:
        """Health-check the servers marked down; return those that answer (still marked down: the
        caller decides whether they may serve again)."""
        down = [s for s in self.slots if not s.healthy]
        results = await asyncio.gather(*(s.client.health() for s in down))
        return [slot for slot, ok in zip(down, results) if ok]

    def _notify(self) -> None:
        self._changed.notify()

    # ----- accounting

    def busy_seconds(self) -> float:
        """Sum over servers of time spent with at least one of our requests in flight."""
        now = self._clock()
        return sum(s.busy_s + (now - s.busy_since if s.busy_since is not None else 0.0) for s in self.slots)
