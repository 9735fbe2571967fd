"""Connection limits of the embedded server: header and idle timeouts, and a bound on open connections.

aiohttp keeps a connection that has sent part of its headers open for as long as the peer likes
(its keep-alive timeout is an hour), so a few hundred such connections exhaust the process's file
descriptors and nothing else can connect. ``ConnectionGuard`` wraps each connection's protocol and
knows, from the API's middleware, whether a request is being handled on it:

- a connection that has not completed a request's headers within ``header_timeout_s`` of opening,
  or that sits between requests for ``idle_timeout_s``, is closed (a sweep each second);
- past ``max_connections`` (at most half the process's file limit, which ``raise_file_limit``
  lifts to the hard limit at start, as SGLang does), a new connection evicts another. A client
  without the key must not be able to hold slots that the key holder (the trainer) needs, so the
  one evicted is, in this order: the oldest connection handling a request without the key; the
  connection that has waited longest without a request and never carried one with the key
  (half-sent headers among them); the key holder's longest-idle keep-alive connection. Only when
  every connection is handling a request with the key is the new one closed instead. A client
  that sends its request at once is not the one evicted, so a flood of half-sent headers or of
  keyless requests cannot keep /health or the trainer out. Without an API key every request
  counts as carrying it.

The body of a request is read under the API's own deadline (``body_timeout_s``).
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
SWEEP_S = 1.0


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """How long a connection may take to send a request, idle between requests or send a body, and how many
    may be open at once."""

    header_timeout_s: float = 10.0  # from connecting (or the previous reply) to a request's complete headers
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request after its last reply
    body_timeout_s: float = 60.0  # reading one request's body
    max_connections: int = 4096  # and never more than half the process's file limit

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "idle_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be > 0")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: {self.max_connections} must be >= 1")


@dataclass(eq=False)
class _Connection:
    transport: asyncio.Transport
    since: float  # when it connected, or when its last request finished
    served: int = 0  # requests finished on it
    busy: int = 0  # requests being handled on it now
    busy_keyless: int = 0  # ... of which without the key
    keyed: bool = False  # it has carried a request with the key (the trainer's keep-alive connection)


class ConnectionGuard:
    """Tracks the server's connections; ``wrap`` its protocol factory, and call ``started``/``finished``
    around each request's handling (the API's middleware does)."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self._clock = limits, clock
        self._open: dict[asyncio.BaseTransport, _Connection] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.evicted = 0  # connections closed to make room, for the log
        self.timed_out = 0

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` whose protocols report to this guard."""
        def make() -> asyncio.Protocol:
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            return _GuardedProtocol(inner(), self)
        return make

    def close(self) -> None:
        """Stop the sweep (the server is shutting down)."""
        if self._sweeper is not None:
            self._sweeper.cancel()

    def limit(self) -> int:
        """``max_connections``, at most half the current soft file limit (the rest is the process's own)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return self.limits.max_connections if soft == resource.RLIM_INFINITY else \
            max(1, min(self.limits.max_connections, soft // 2))

    # ---- called by the protocol and by the API's middleware --------------------------------
    def opened(self, transport: asyncio.Transport) -> None:
        if len(self._open) >= self.limit():
            victim = self._victim()
            if victim is None:
                log.warning("connection limit %d reached with every connection busy with a keyed request: "
                            "refusing one", self.limit())
                transport.abort()
                return
            self.evicted += 1
            victim.transport.abort()
            self._open.pop(victim.transport, None)
        self._open[transport] = _Connection(transport=transport, since=self._clock())

    def _victim(self) -> _Connection | None:
        """The connection a new one replaces (see the module's docstring), or None when all serve the key."""
        conns = list(self._open.values())
        for candidates in ([c for c in conns if c.busy_keyless],
                           [c for c in conns if not c.busy and not c.keyed],
                           [c for c in conns if not c.busy]):
            if candidates:
                return min(candidates, key=lambda c: c.since)
        return None

    def lost(self, transport: asyncio.BaseTransport) -> None:
        self._open.pop(transport, None)

    def started(self, transport: Any, *, keyed: bool = True) -> None:
        """A request's headers arrived on ``transport``: it is no longer waiting for them. ``keyed``: the
        request carries the API key (or the server has none)."""
        conn = self._open.get(transport)
        if conn is not None:
            conn.busy += 1
            if keyed:
                conn.keyed = True
            else:
                conn.busy_keyless += 1
                conn.since = self._clock()  # the oldest keyless request goes first

    def finished(self, transport: Any, *, keyed: bool = True) -> None:
        """The request's handler returned: the idle clock starts again."""
        conn = self._open.get(transport)
        if conn is not None:
            conn.busy = max(0, conn.busy - 1)
            if not keyed:
                conn.busy_keyless = max(0, conn.busy_keyless - 1)
            conn.served += 1
            conn.since = self._clock()

    # ---- the sweep -----------------------------------------------------------------------
    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()

    def sweep(self) -> int:
        """Close every connection past its header or idle deadline; returns how many."""
        now, closed = self._clock(), 0
        for conn in list(self._open.values()):
            allowed = self.limits.idle_timeout_s if conn.served else self.limits.header_timeout_s
            if not conn.busy and now - conn.since > allowed:
                conn.transport.abort()
                self._open.pop(conn.transport, None)
                closed += 1
        self.timed_out += closed
        return closed


def raise_file_limit(wanted: int = 65536) -> int:
    """Lift the soft limit on open files towards ``wanted`` (at most the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, with its opening and closing reported to the guard."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner, self._guard = inner, guard
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._inner.connection_made(transport)
        self._guard.opened(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard.lost(self._transport)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()
