"""The main job's timeline (megatron_areal/rundir/timeline.py): spans tile each role's time, the summary adds
up to the wall time, and the file is a Chrome trace by the Trace Event Format's rules.

The expected spans of the scripted run are worked out by hand from the script below. The run's
own timeline (``timeline.json`` of a real ``megatron-areal train``) is checked by
``test_main_job.py`` with ``assert_run_timeline`` from here.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from megatron_areal.rundir import timeline
from megatron_areal.rundir.layout import RunDir
from megatron_areal.rundir.timeline import SERVER_PRIORITY, Span, Timeline


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def assert_chrome_trace(trace: dict) -> dict[str, list[dict]]:
    """The Trace Event Format (JSON object form): ``traceEvents`` a list; every event has ``name``, ``ph``,
    ``pid``, ``tid``; complete events ("X") a ``ts`` and a non-negative ``dur`` in microseconds; metadata
    ("M") ``thread_name`` names each thread. Returns each named thread's X events, in time order, after
    checking that they neither overlap nor leave gaps (each role is always in one activity)."""
    assert isinstance(trace["traceEvents"], list)
    names: dict[int, str] = {}
    spans: dict[int, list[dict]] = {}
    for ev in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(ev), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        if ev["ph"] == "M" and ev["name"] == "thread_name":
            names[ev["tid"]] = ev["args"]["name"]
        elif ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float)), ev
            assert ev["ts"] >= 0 and ev["dur"] > 0, ev
            spans.setdefault(ev["tid"], []).append(ev)
        else:
            assert ev["ph"] == "M", ev
    assert set(spans) <= set(names), "a thread without a name"
    out = {}
    for tid, events in spans.items():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=2.0), (names[tid], a, b)  # 2 us: rounding
        out[names[tid]] = events
    return out


def assert_run_timeline(run_dir: Path, steps: int) -> None:
    """A finished run's timeline: valid trace, each role's activities add up to its wall time, and the
    trainer's phases and the servers' work are on it."""
    trace = json.loads(RunDir(run_dir).timeline.read_text())
    roles = assert_chrome_trace(trace)
    summary = json.loads(RunDir(run_dir).timeline_summary.read_text())
    for name, role in summary["roles"].items():
        assert sum(role["activities"].values()) == pytest.approx(role["wall_s"], abs=1e-3), name
        assert role["wall_s"] <= summary["wall_s"] + 1e-6, name
        seen = sum(e["dur"] for e in roles[name]) / 1e6
        assert seen == pytest.approx(role["wall_s"], abs=1e-3), name
    trainer = summary["roles"]["trainer"]["activities"]
    for phase in ("launching servers", "waiting for servers", "loading model", "waiting for batch", "training",
                  "weight update", "checkpointing"):
        assert trainer.get(phase, 0) > 0, (phase, trainer)
    assert summary["roles"]["trainer"]["wall_s"] == pytest.approx(summary["wall_s"])  # begins with the run
    pushes = [e for e in roles["trainer"] if e["name"] == "weight update"]
    assert len(pushes) == steps
    servers = [n for n in summary["roles"] if n.startswith("server ")]
    assert servers
    for name in servers:
        acts = summary["roles"][name]["activities"]
        assert acts.get("generating", 0) > 0 and acts.get("weight update", 0) > 0, (name, acts)
        assert len([e for e in roles[name] if e["name"] == "weight update"]) == steps
    assert any(n.startswith("reward-worker") for n in summary["roles"])
    assert summary["roles"][timeline.ROLLOUT_LOOP]["activities"].get("paused", 0) > 0


def scripted_timeline() -> tuple[Timeline, FakeClock]:
    clock = FakeClock()
    tl = Timeline(origin=90.0, clock=clock)  # the run began 10 s before "now"
    tl.add_role("trainer", "waiting for servers", at=0.0, first=("launching servers", 4.0))
    tl.add_role("server a", "idle", at=0.0, priority=SERVER_PRIORITY, first=("starting up", 6.0))
    clock.t = 102.0  # t = 12
    tl.enter("trainer", "loading model")
    tl.enter("server a", "generating")
    clock.t = 103.0  # t = 13: a second request, and the trainer nests a phase
    tl.enter("server a", "generating")
    tl.enter("trainer", "training")
    clock.t = 104.0  # t = 14: weight update outranks the requests still in flight
    tl.enter("server a", "weight update")
    tl.leave("server a", "generating")
    tl.leave("trainer", "training")
    clock.t = 105.0  # t = 15
    tl.leave("server a", "weight update")  # one request left: generating again
    tl.leave("trainer", "loading model")
    clock.t = 107.0  # t = 17
    tl.leave("server a", "generating")
    tl.set_state("trainer", "between steps")
    clock.t = 109.0  # t = 19: a reward worker scored for the last 1.5 s
    tl.record("reward-worker-1", "scoring", 1.5)
    clock.t = 110.0  # t = 20
    return tl, clock


def test_spans_follow_the_script() -> None:
    tl, _ = scripted_timeline()
    spans = tl.spans()
    assert spans["trainer"] == [Span("launching servers", 0, 4), Span("waiting for servers", 4, 12),
                                Span("loading model", 12, 13), Span("training", 13, 14),
                                Span("loading model", 14, 15), Span("waiting for servers", 15, 17),
                                Span("between steps", 17, 20)]
    assert spans["server a"] == [Span("starting up", 0, 6), Span("idle", 6, 12), Span("generating", 12, 14),
                                 Span("weight update", 14, 15), Span("generating", 15, 17), Span("idle", 17, 20)]
    # first seen when its first call ended: the role begins with that call
    assert spans["reward-worker-1"] == [Span("scoring", 17.5, 19), Span("idle", 19, 20)]


def test_record_inside_a_role_that_began_earlier() -> None:
    clock = FakeClock()
    tl = Timeline(origin=100.0, clock=clock)
    tl.add_role("reward-worker-1", "idle", at=0.0)
    clock.t = 105.0
    tl.record("reward-worker-1", "scoring", 2.0)
    clock.t = 106.0
    assert tl.spans()["reward-worker-1"] == [Span("idle", 0, 3), Span("scoring", 3, 5), Span("idle", 5, 6)]


def test_summary_adds_up_to_wall_time_and_trace_is_valid(tmp_path: Path) -> None:
    tl, _ = scripted_timeline()
    summary = timeline.write(tl, RunDir(tmp_path).timeline, RunDir(tmp_path).timeline_summary)
    assert summary.check() == []
    assert summary.wall_s == pytest.approx(20.0)
    assert summary.roles["trainer"] == pytest.approx({"launching servers": 4, "waiting for servers": 10,
                                                      "loading model": 2, "training": 1, "between steps": 3})
    assert summary.roles["server a"] == pytest.approx({"starting up": 6, "idle": 9, "generating": 4,
                                                       "weight update": 1})
    roles = assert_chrome_trace(json.loads(RunDir(tmp_path).timeline.read_text()))
    assert [e["name"] for e in roles["server a"]] == ["starting up", "idle", "generating", "weight update",
                                                      "generating", "idle"]
    assert roles["trainer"][2]["ts"] == pytest.approx(12e6) and roles["trainer"][2]["dur"] == pytest.approx(1e6)
    assert "server a" in summary.table() and "20.0 s" in summary.table()


def test_leaving_an_activity_never_entered_raises() -> None:
    tl = Timeline()
    tl.enter("server a", "generating")
    with pytest.raises(RuntimeError, match="never entered"):
        tl.leave("server a", "evaluating")


def test_hooks_do_nothing_without_a_timeline() -> None:
    timeline.install(None)
    timeline.enter("server a", "generating")
    timeline.leave("server b", "evaluating")  # would raise on a timeline
    with timeline.activity(["x", "y"], "z"):
        pass
    assert timeline.server_roles() == []


def test_concurrent_holds_from_many_threads_balance() -> None:
    tl = Timeline()
    timeline.install(tl)
    try:
        def requests() -> None:
            for _ in range(200):
                with timeline.activity(timeline.server_role("http://127.0.0.1:30001"), "generating"):
                    timeline.set_state(timeline.ROLLOUT_LOOP, "submitting")
        threads = [threading.Thread(target=requests) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        role = "server 127.0.0.1:30001"
        assert timeline.server_roles() == [role]
        end = tl.now()
        summary = timeline.summarize(tl.spans(end), tl.starts(), end)
        assert summary.check() == []
        assert tl.spans()[role][-1].activity == "idle"  # every request left
    finally:
        timeline.install(None)
