"""Where the main job's time goes: every role's activity over the run, as a Chrome trace and a table.

A role (the trainer, rank 0's rollout loop, each rollout server, each reward worker, the held-out
evaluation) is at every instant in exactly one activity, so its spans tile the time from the role's
start to the end of the run, and its seconds per activity add up to its wall time (``check``).

An activity is the role's base state (``set_state``) unless something holds the role (``enter`` /
``leave``, or the ``activity`` context). Holds are counted, so a server with sixteen requests in flight
stays "generating" until the last one ends; when holds of several kinds overlap, the role's priority
order names the span (a paused server with requests in flight is in its "weight update"), else the
newest hold does (the trainer's nested phases).

Servers are other processes; their activity is what trainer rank 0 sees of them: "generating" while
one of our rollout requests is on the server, "evaluating" while held-out requests are, "weight
update" while the trainer pushes weights, otherwise "idle". Request time includes the HTTP round
trip, and a server with a request may still be between decode steps; the servers' own step
counters are not consulted.

Hooks call the module functions, which act on the timeline ``install`` made current and do nothing
when none is (tests, tools, trainer ranks other than 0).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

SERVER_PRIORITY = ("weight update", "evaluating", "generating")
ROLLOUT_LOOP = "rollout loop"  # rank 0's submission of groups (rollout/loop.py)
TOLERANCE_S = 1e-6


@dataclass(frozen=True)
class Span:
    """``activity`` from ``start`` to ``end``, in seconds since the timeline's origin."""

    activity: str
    start: float
    end: float


@dataclass
class Role:
    """One role's record: closed spans, the base state, the counted holds and the open span."""

    name: str
    start: float
    state: str
    priority: tuple[str, ...] = ()
    spans: list[Span] = field(default_factory=list)
    holds: list[str] = field(default_factory=list)  # in the order they were entered
    since: float = 0.0  # start of the open span

    def __post_init__(self) -> None:
        self.since = self.start

    @property
    def current(self) -> str:
        """The activity that names the open span."""
        if not self.holds:
            return self.state
        ranked = [h for h in self.priority if h in self.holds]
        return ranked[0] if ranked else self.holds[-1]

    def switch(self, now: float, change: Callable[[], None]) -> None:
        """Apply ``change`` at ``now``; close the open span when it changes what the role is doing."""
        before = self.current
        change()
        if self.current != before:
            if now > self.since:
                self.spans.append(Span(before, self.since, now))
            self.since = max(self.since, now)

    def closed_at(self, end: float) -> list[Span]:
        """The spans with the open one closed at ``end``."""
        return self.spans + ([Span(self.current, self.since, end)] if end > self.since else [])


class Timeline:
    """Thread-safe record of every role's activities; times are seconds since ``origin`` (monotonic)."""

    def __init__(self, origin: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.origin = clock() if origin is None else origin
        self.origin_epoch = time.time() - (clock() - self.origin)  # for the reader: when the run began
        self._roles: dict[str, Role] = {}
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock() - self.origin

    def add_role(self, name: str, state: str, *, at: float | None = None, priority: tuple[str, ...] = (),
                 first: tuple[str, float] | None = None) -> None:
        """Start recording ``name`` at ``at`` (seconds since the origin; default now) in ``state``, or
        with ``first`` = (activity, until) in that activity up to ``until`` (a past instant) and then in
        ``state``. A role already recorded is left as it is."""
        with self._lock:
            if name in self._roles:
                return
            now = self.now()
            start = min(now, now if at is None else at)
            role = self._roles[name] = Role(name, start, state, priority)
            if first is not None:
                until = min(now, max(start, first[1]))
                if until > start:
                    role.spans.append(Span(first[0], start, until))
                role.since = until

    def _role(self, name: str) -> Role:
        """A role seen for the first time starts now, idle (servers get their priority order)."""
        role = self._roles.get(name)
        if role is None:
            role = self._roles[name] = Role(name, self.now(), "idle",
                                            SERVER_PRIORITY if name.startswith("server ") else ())
        return role

    def set_state(self, name: str, state: str) -> None:
        """The role's base state from now on (shown while nothing holds it)."""
        with self._lock:
            role = self._role(name)
            role.switch(self.now(), lambda: setattr(role, "state", state))

    def enter(self, name: str, activity: str) -> None:
        """Hold ``name`` in ``activity`` (counted: each ``enter`` needs its ``leave``)."""
        with self._lock:
            role = self._role(name)
            role.switch(self.now(), lambda: role.holds.append(activity))

    def leave(self, name: str, activity: str) -> None:
        """Release one hold of ``activity``; releasing one that is not held is a bug and raises."""
        with self._lock:
            role = self._role(name)
            if activity not in role.holds:
                raise RuntimeError(f"timeline: role {name!r} leaves {activity!r} it never entered")
            index = len(role.holds) - 1 - role.holds[::-1].index(activity)
            role.switch(self.now(), lambda: role.holds.pop(index))

    def record(self, name: str, activity: str, seconds: float) -> None:
        """``activity`` for the last ``seconds`` of a role used by one thread at a time (a reward worker,
        whose own clock measured the call); the role returns to its base state."""
        with self._lock:
            end = self.now()
            if name not in self._roles:  # first seen: the role began with this call
                self._roles[name] = Role(name, max(0.0, end - seconds), "idle")
            role = self._roles[name]
            start = max(role.since, end - seconds)
            if start > role.since:
                role.spans.append(Span(role.current, role.since, start))
            if end > start:
                role.spans.append(Span(activity, start, end))
            role.since = end

    def roles(self) -> list[str]:
        with self._lock:
            return list(self._roles)

    def spans(self, end: float | None = None) -> dict[str, list[Span]]:
        """Every role's spans, open ones closed at ``end`` (default now)."""
        with self._lock:
            end = self.now() if end is None else end
            return {name: role.closed_at(end) for name, role in self._roles.items()}

    def starts(self) -> dict[str, float]:
        with self._lock:
            return {name: role.start for name, role in self._roles.items()}


@dataclass(frozen=True)
class Summary:
    """Seconds per activity per role, and each role's wall time (its start to the end of the run)."""

    wall_s: float
    roles: dict[str, dict[str, float]]
    role_wall_s: dict[str, float]

    def check(self) -> list[str]:
        """Roles whose activities do not add up to their wall time (empty when the accounting holds)."""
        return [f"{name}: activities sum to {sum(acts.values()):.6f} s, wall {self.role_wall_s[name]:.6f} s"
                for name, acts in self.roles.items()
                if abs(sum(acts.values()) - self.role_wall_s[name]) > TOLERANCE_S * max(1.0, len(acts))]

    def table(self) -> str:
        """One line per role: its wall time and each activity's seconds and share, largest first."""
        width = max((len(n) for n in self.roles), default=4)
        lines = [f"timeline over {self.wall_s:.1f} s (seconds per activity; each role's add up to its wall time):"]
        for name, acts in self.roles.items():
            wall = self.role_wall_s[name]
            parts = " | ".join(f"{a} {s:.1f} ({100 * s / max(wall, 1e-9):.0f}%)"
                               for a, s in sorted(acts.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {name:<{width}}  {wall:7.1f} s: {parts}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "roles": {n: {"wall_s": self.role_wall_s[n], "activities": a}
                                                 for n, a in self.roles.items()}}


def summarize(spans: dict[str, list[Span]], starts: dict[str, float], end: float) -> Summary:
    roles: dict[str, dict[str, float]] = {}
    for name, role_spans in spans.items():
        acts: dict[str, float] = {}
        for s in role_spans:
            acts[s.activity] = acts.get(s.activity, 0.0) + (s.end - s.start)
        roles[name] = acts
    return Summary(wall_s=end, roles=roles, role_wall_s={n: end - starts[n] for n in spans})


def chrome_trace(spans: dict[str, list[Span]], origin_epoch: float) -> dict:
    """The Trace Event Format's JSON object: one thread per role, one complete ("X") event per span,
    microseconds since the run began."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "main job"}}]
    for tid, (name, role_spans) in enumerate(spans.items(), start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        events.extend({"name": s.activity, "cat": name, "ph": "X", "pid": 1, "tid": tid,
                       "ts": round(s.start * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3)}
                      for s in role_spans)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_epoch_s": origin_epoch}}


def write(timeline: Timeline, trace: Path, summary_file: Path) -> Summary:
    """Close every role now, write the Chrome trace (open it in ui.perfetto.dev or chrome://tracing) to
    ``trace`` and the summary to ``summary_file``, log the table; warns when the accounting fails."""
    end = timeline.now()
    spans, starts = timeline.spans(end), timeline.starts()
    summary = summarize(spans, starts, end)
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text(json.dumps(chrome_trace(spans, timeline.origin_epoch)))
    summary_file.write_text(json.dumps(summary.to_dict(), indent=1))
    logger.info("%s\nwrote %s", summary.table(), trace)
    for problem in summary.check():
        logger.warning("timeline accounting: %s", problem)
    return summary


# ----- the current timeline, for the hooks

_current: Timeline | None = None


def install(timeline: Timeline | None) -> None:
    """Make ``timeline`` the one the hooks record into (None: hooks do nothing)."""
    global _current
    _current = timeline


def current() -> Timeline | None:
    return _current


def set_state(role: str, state: str) -> None:
    if _current is not None:
        _current.set_state(role, state)


def enter(role: str, activity: str) -> None:
    if _current is not None:
        _current.enter(role, activity)


def leave(role: str, activity: str) -> None:
    if _current is not None:
        _current.leave(role, activity)


def record(role: str, activity: str, seconds: float) -> None:
    if _current is not None:
        _current.record(role, activity, seconds)


@contextmanager
def activity(roles: str | list[str], name: str) -> Iterator[None]:
    """Hold each of ``roles`` in activity ``name`` for the ``with`` block."""
    held = [roles] if isinstance(roles, str) else list(roles)
    for role in held:
        enter(role, name)
    try:
        yield
    finally:
        for role in held:
            leave(role, name)


def server_role(url: str) -> str:
    """The role name of the rollout server at ``url``."""
    parts = urlsplit(url)
    return f"server {parts.hostname}:{parts.port}" if parts.port else f"server {url}"


def server_roles() -> list[str]:
    """The server roles seen so far."""
    return [r for r in _current.roles() if r.startswith("server ")] if _current is not None else []
