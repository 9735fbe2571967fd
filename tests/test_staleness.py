"""The staleness gate: the admission rule, its bookkeeping, and impossible states."""
from __future__ import annotations

import re
import threading

import pytest

from megatron_areal.algorithm import staleness_capacity
from megatron_areal.rollout.staleness import GateError, StalenessGate


def test_capacity_follows_formula_through_transitions():
    gate = StalenessGate(eta=1, batch_size=4, max_concurrent=6)
    assert gate.capacity() == 6  # (1+0+1)*4 = 8 by staleness, 6 by concurrency
    for _ in range(6):
        gate.on_submit()
    assert gate.capacity() == 0
    for _ in range(4):
        gate.on_accept()
    c = gate.counts()
    assert (c.running, c.accepted) == (2, 4)
    assert gate.capacity() == staleness_capacity(1, 0, 4, 4, 2, 6) == 2
    gate.on_submit()
    gate.on_submit()
    assert gate.capacity() == 0 and not gate.try_submit()
    gate.on_version(1)  # trainer consumed one batch: 4 more by staleness, 2 by concurrency
    assert gate.capacity() == 2
    gate.on_reject()
    assert gate.capacity() == 3


def test_eta_zero_allows_exactly_one_batch_per_version():
    gate = StalenessGate(eta=0, batch_size=3, max_concurrent=100)
    assert sum(gate.try_submit() for _ in range(10)) == 3
    for _ in range(3):
        gate.on_accept()
    assert gate.capacity() == 0
    gate.on_version(1)
    assert sum(gate.try_submit() for _ in range(10)) == 3


def test_drop_frees_a_slot():
    gate = StalenessGate(eta=0, batch_size=2, max_concurrent=10)
    gate.on_submit()
    gate.on_submit()
    gate.on_accept()
    gate.on_accept()
    assert gate.capacity() == 0
    gate.on_drop()
    assert gate.capacity() == 1 and gate.counts().dropped == 1


@pytest.mark.parametrize("event", ["on_accept", "on_reject", "on_drop"])
def test_impossible_transitions_raise(event):
    gate = StalenessGate(eta=2, batch_size=2, max_concurrent=4)
    with pytest.raises(GateError, match="negative"):
        getattr(gate, event)()
    assert gate.counts().running == 0 and gate.counts().accepted == 0  # unchanged


def test_submit_without_capacity_and_backwards_version_raise():
    gate = StalenessGate(eta=0, batch_size=1, max_concurrent=4)
    gate.on_version(3)
    for _ in range(4):
        gate.on_submit()
    with pytest.raises(GateError, match="capacity"):
        gate.on_submit()
    with pytest.raises(GateError, match="backwards"):
        gate.on_version(2)
    with pytest.raises(ValueError, match="eta must be >= 0, got -1"):
        StalenessGate(eta=-1, batch_size=1, max_concurrent=1)


def test_state_dict_round_trip_excludes_running():
    gate = StalenessGate(eta=1, batch_size=2, max_concurrent=8)
    for _ in range(3):
        gate.on_submit()
    gate.on_accept()
    gate.on_version(1)
    state = gate.state_dict()
    assert "running" not in state
    fresh = StalenessGate(eta=1, batch_size=2, max_concurrent=8)
    fresh.load_state_dict(state)
    c = fresh.counts()
    assert (c.version, c.accepted, c.running, c.submitted) == (1, 1, 0, 3)
    with pytest.raises(GateError):
        gate.load_state_dict(state)  # groups still running there


def test_concurrent_submissions_never_exceed_capacity():
    gate = StalenessGate(eta=2, batch_size=5, max_concurrent=1000)
    granted = []

    def worker():
        granted.append(sum(gate.try_submit() for _ in range(50)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 15 == gate.counts().running


def test_listener_sees_capacity_before_each_event():
    gate = StalenessGate(eta=0, batch_size=2, max_concurrent=8)
    seen = []
    gate.add_listener(lambda ev, c, cap: seen.append((ev, c.running, cap)))
    gate.on_submit()
    gate.on_submit()
    gate.on_accept()
    assert seen == [("submit", 1, 2), ("submit", 2, 1), ("accept", 1, 0)]


@pytest.mark.parametrize(("overrides", "named"), [
    (["staleness.eta=-1"], "staleness.eta: must be >= 0"),
    (["staleness.overlap=false", "staleness.eta=2"], "staleness.overlap: false (synchronous mode) requires"),
])
def test_a_bad_staleness_section_is_refused_by_its_one_check(overrides: list[str], named: str) -> None:
    """The section's own ``validate`` holds both rules on eta: at load, and for a section built in code that
    reaches the rollout controller without being loaded."""
    from megatron_areal.config import load_config
    from megatron_areal.configbase import ConfigError
    from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
    from megatron_areal.rollout.controller import RolloutController

    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, overrides)
    section = StalenessConfig(eta=int(overrides[-1].split("=")[1]), overlap="overlap=false" not in overrides[0])
    with pytest.raises(ConfigError, match=re.escape(named.removeprefix("staleness."))):
        RolloutController(RolloutConfig(), section, ["http://127.0.0.1:9"], [], list, str, None)
