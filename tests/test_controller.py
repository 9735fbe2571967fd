"""The rollout controller against test servers with random latencies and output lengths.

The servers (``rollout_fakes``) speak generate / pause / continue / abort / health; what is
under test is the controller: the capacity rule at every submission, the staleness bound on
trained data, per-token versions across interruptions, routing, failover and resume.
"""
from __future__ import annotations

import logging
import random
import time

import pytest
from rollout_fakes import FakeFleet, FakeServer, ListPrompts, ParityScorer, decode, encode

from megatron_areal.records import Trajectory
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.controller import RolloutController, RolloutError
from megatron_areal.weights.endpoints import weight_calls


def make_controller(fleet: FakeFleet, prompts: ListPrompts, *, eta: int, **kw) -> RolloutController:
    cfg = RolloutConfig(**{"batch_size": 4, "group_size": 3, "max_new_tokens": 48, "max_concurrent": 12,
                           "filter_equal_rewards": False, "health_interval_s": 0.2, **kw})
    return RolloutController(cfg, StalenessConfig(eta=eta, overlap=eta > 0), fleet.urls, prompts,
                             encode, decode, ParityScorer())


def weight_update(ctl: RolloutController, fleet: FakeFleet, version: int, how: str = "controller") -> None:
    """``controller``: the controller pauses and continues the servers around the update;
    ``held``: the weight mover does, the controller only holds its own work meanwhile;
    ``unannounced``: the weight mover does, the controller only learns the new version after."""
    if how == "controller":
        ctl.pause_generation()
        fleet.set_version(version)
        ctl.resume_generation(version)
    elif how == "held":
        ctl.pause_generation(pause_servers=False)
        fleet.update_behind_controllers_back(version)
        ctl.resume_generation(version, resume_servers=False)
    else:
        fleet.update_behind_controllers_back(version)
        ctl.set_version(version)


def check_tokens(t: Trajectory) -> None:
    """Per-token versions and logprobs agree with what the server encoded in each token."""
    assert len(t.output_ids) == len(t.output_logprobs) == len(t.output_versions) > 0
    assert t.output_versions == [tok // 1000 for tok in t.output_ids]
    assert t.output_logprobs == [-(tok % 1000) / 1000 for tok in t.output_ids]
    assert t.output_versions == sorted(t.output_versions)
    assert t.start_version <= t.output_versions[0]


@pytest.fixture
def fleet3():
    fleet = FakeFleet([FakeServer(seed=i) for i in range(3)])
    yield fleet
    fleet.close()


def test_staleness_bound_capacity_rule_and_versions(fleet3):
    eta, batch = 2, 4
    ctl = make_controller(fleet3, ListPrompts(10_000), eta=eta, batch_size=batch)
    submissions = []
    ctl.gate.add_listener(lambda ev, c, cap: submissions.append((c, cap)) if ev == "submit" else None)
    rng = random.Random(0)
    trained, interrupted = [], []
    with ctl:
        for step in range(9):
            got = ctl.get_batch(timeout=60)
            assert len(got) == batch * 3
            for t in got:
                check_tokens(t)
                assert step - t.output_versions[0] <= eta  # judged by the server's own versions
                assert step - t.start_version <= eta
            trained += got
            interrupted += [t for t in got if len(set(t.output_versions)) > 1]
            time.sleep(rng.uniform(0, 0.05))  # training
            weight_update(ctl, fleet3, step + 1, how=("controller", "held", "unannounced")[step % 3])
        metrics = ctl.metrics()
        submitted = ctl.gate.counts().submitted
    assert submissions and all(cap >= 1 for _, cap in submissions)
    for c, _ in submissions:  # the counts just after each submission still satisfy the rule
        assert c.running <= 12
        assert c.accepted + c.running <= (eta + c.version + 1) * batch
    # The servers saw no group the gate did not count.
    first_segments = {r["rid"].rsplit("-", 1)[0] for s in fleet3.servers for r in s.requests}
    assert len(first_segments) <= submitted
    # Samples cut by an update hold old-version tokens, then new ones.
    assert interrupted, "no sample crossed a weight update; the test lost its point"
    assert all(t.interruptions >= 1 for t in interrupted)
    assert metrics["rollout/staleness_max"] <= eta
    assert {"rollout/reward_mean", "rollout/dropped_stale", "rollout/filtered_groups",
            "perf/gen_tokens_per_s", "perf/generator_idle_fraction"} <= set(metrics)
    assert metrics["perf/gen_tokens_per_s"] > 0


def test_group_that_outlives_eta_is_dropped_and_counted(caplog):
    fleet = FakeFleet([FakeServer(seed=i, slow_prompt=0) for i in range(2)])
    try:
        ctl = make_controller(fleet, ListPrompts(10_000), eta=1, max_new_tokens=24)
        trained = []
        with caplog.at_level(logging.INFO, logger="megatron_areal.rollout.loop"), ctl:
            for step in range(200):
                trained += [(step, t) for t in ctl.get_batch(timeout=60)]
                weight_update(ctl, fleet, step + 1)
                if any("(prompt 0)" in r.message for r in caplog.records):
                    break
            metrics = ctl.metrics()
        dropped = [r.message for r in caplog.records if "dropped stale group" in r.message]
        assert len(dropped) == metrics["rollout/dropped_stale"] >= 1
        assert any("(prompt 0)" in m for m in dropped)
        assert 0 not in {t.prompt_index for _, t in trained}
        assert all(step - t.start_version <= 1 for step, t in trained)
    finally:
        fleet.close()


def test_synchronous_mode_generates_nothing_while_training(fleet3):
    ctl = make_controller(fleet3, ListPrompts(10_000), eta=0)
    with ctl:
        for step in range(3):
            got = ctl.get_batch(timeout=60)
            assert {t.start_version for t in got} == {step}
            assert ctl.gate.counts().running == 0 and ctl.gate.capacity() == 0
            t_train = time.monotonic()
            time.sleep(0.1)
            assert not [r for s in fleet3.servers for r in s.requests if r["time"] > t_train]
            weight_update(ctl, fleet3, step + 1)


def test_asynchronous_mode_keeps_generators_busier_than_synchronous(fleet3):
    idle = {}
    for eta in (0, 4):
        ctl = make_controller(fleet3, ListPrompts(10_000), eta=eta)
        with ctl:
            ctl.get_batch(timeout=60)
            ctl.metrics()  # start the measurement window after the first batch
            for step in range(1, 5):
                time.sleep(0.1)  # training
                weight_update(ctl, fleet3, step)
                ctl.get_batch(timeout=60)
            idle[eta] = ctl.metrics()["perf/generator_idle_fraction"]
        fleet3.set_version(0)
    assert 0 <= idle[4] < idle[0] <= 1
    assert idle[0] > 0.2  # synchronous: idle through every training step and every batch's tail


def test_routing_prefers_least_loaded_server():
    slow = FakeServer(seed=1, token_delay=(0.02, 0.02), stop_prob=0.0)
    fast = FakeServer(seed=2, token_delay=(0.001, 0.001), stop_prob=0.0)
    fleet = FakeFleet([slow, fast])
    try:
        # One sample per group, so a group never waits on the slow server for its siblings.
        ctl = make_controller(fleet, ListPrompts(10_000), eta=8, group_size=1, max_new_tokens=8,
                              max_concurrent=4)
        with ctl:
            for _ in range(8):
                ctl.get_batch(timeout=60)
        # Round-robin or random routing would split about evenly.
        assert len(fast.requests) > 3 * len(slow.requests)
        assert len(slow.requests) >= 1
    finally:
        fleet.close()


def test_dead_server_is_rerouted_around_and_rejoins_only_with_current_weights(caplog):
    fleet = FakeFleet([FakeServer(seed=i, token_delay=(0.003, 0.006)) for i in range(3)])
    victim = fleet.servers[0]
    try:
        ctl = make_controller(fleet, ListPrompts(10_000), eta=4)
        with caplog.at_level(logging.WARNING), ctl:
            ctl.get_batch(timeout=60)
            while victim.active == 0:
                time.sleep(0.001)
            fleet.run(victim.kill())
            n_seen = len(victim.requests)
            for _ in range(3):
                for t in ctl.get_batch(timeout=60):
                    check_tokens(t)
            metrics = ctl.metrics()
            # Restarted with the old weights, it answers health probes but is kept out ...
            weight_update(ctl, fleet, 1)
            victim.version = 0
            fleet.run(victim.start())
            time.sleep(0.7)
            assert ctl.metrics()["rollout/healthy_servers"] == 2 and not victim.requests[n_seen:]
            # ... until a weight sync brings it to the current version.
            victim.version = 1
            deadline = time.monotonic() + 20
            while ctl.metrics()["rollout/healthy_servers"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            for version in range(2, 20):  # train on until new work has been routed
                for t in ctl.get_batch(timeout=60):
                    check_tokens(t)
                weight_update(ctl, fleet, version)
                if victim.requests[n_seen:]:
                    break
        assert victim.requests[n_seen:], "the updated server got no work after rejoining"
        assert any("holds weights version '0'" in r.message for r in caplog.records)
        assert metrics["rollout/healthy_servers"] == 2
        assert metrics["rollout/request_failures"] >= 1
        assert any("unhealthy" in r.message and victim.url in r.message for r in caplog.records)
        # Samples cut off on the victim were continued by the other servers (same sample, next segment).
        cut = {rid.split(".")[0] for rid in victim.cut}
        elsewhere = {r["rid"].split(".")[0] for s in fleet.servers[1:] for r in s.requests}
        assert cut and cut <= elsewhere
    finally:
        fleet.close()


def test_state_dict_round_trip_requeues_in_flight_prompts():
    n_prompts, batch = 24, 4
    fleet = FakeFleet([FakeServer(seed=i, token_delay=(0.002, 0.01)) for i in range(2)])
    try:
        first = make_controller(fleet, ListPrompts(n_prompts), eta=100, batch_size=batch)
        trained: list[int] = []
        with first:
            for step in range(2):
                trained += sorted({t.prompt_index for t in first.get_batch(timeout=60)})
                weight_update(first, fleet, step + 1)
            state = first.state_dict()  # then a "crash": everything after this is lost
        assert state["requeue"], "nothing in flight at save time; the test lost its point"
        prompts = ListPrompts(n_prompts)
        second = make_controller(fleet, prompts, eta=100, batch_size=batch)
        second.load_state_dict(state)
        assert second.version == 2
        with second:
            while True:
                try:
                    trained += sorted({t.prompt_index for t in second.get_batch(timeout=60)})
                except RolloutError as e:
                    assert "exhausted" in str(e)
                    break
        assert sorted(trained) == list(range(n_prompts))  # none lost, none twice
    finally:
        fleet.close()


def test_get_batch_timeout_says_what_is_missing():
    fleet = FakeFleet([FakeServer(seed=0, token_delay=(0.05, 0.05), stop_prob=0.0)])
    try:
        ctl = make_controller(fleet, ListPrompts(10_000), eta=1, max_new_tokens=40)
        with ctl, pytest.raises(RolloutError, match=r"0 of 4 admissible groups .* version 0 \(eta 1\)"):
            ctl.get_batch(timeout=0.3)
    finally:
        fleet.close()


def test_rejected_request_skips_its_group_and_lost_fleet_is_reported(caplog):
    fleet = FakeFleet([FakeServer(seed=0, reject_prompt=1)])
    try:
        ctl = make_controller(fleet, ListPrompts(10_000), eta=4)
        with ctl:
            trained = {t.prompt_index for _ in range(3) for t in ctl.get_batch(timeout=60)}
            assert 1 not in trained and ctl.metrics()["rollout/sample_failures"] == 1
            fleet.run(fleet.servers[0].kill())
            with pytest.raises(RolloutError, match=rf"servers down 1/1 \({fleet.urls[0]}\)"):
                for _ in range(100):
                    ctl.get_batch(timeout=0.5)
    finally:
        fleet.close()


@pytest.mark.slow
def test_with_embedded_server_across_weight_updates(tiny_llama):
    """One real embedded server process, the real prompt stream, tokenizer and reward pool, and
    real weight updates (from disk, as versions 1, 2, 3) while samples are being decoded."""
    import asyncio

    from transformers import AutoTokenizer

    from megatron_areal.data import PromptStream, encode_prompt, load_task
    from megatron_areal.fleet.client import RolloutClient
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.reward import RewardConfig, RewardService

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    stream = PromptStream(load_task("arithmetic", seed=0, size=64), seed=0)
    cfg = RolloutConfig(batch_size=2, group_size=2, max_new_tokens=96, max_concurrent=4,
                        filter_equal_rewards=False, temperature=1.0)

    async def server_call(url: str, version: int | None = None) -> int:
        """Load a new policy version (same files: what matters is the version) or read the load."""
        async with RolloutClient(url) as client:
            if version is None:
                return await client.load()
            await weight_calls(client).update_weights_from_disk(str(tiny_llama), weight_version=str(version))
            return 0

    trained: list[tuple[int, Trajectory]] = []
    with start_embedded(tiny_llama, args=["--max-running", "8"]) as server, \
            RewardService(RewardConfig(workers=1), tasks=["arithmetic"]) as rewards:
        ctl = RolloutController(cfg, StalenessConfig(eta=1), [server.url], stream,
                                lambda p: encode_prompt(tokenizer, p, True), tokenizer.decode, rewards)
        with ctl:
            for version in range(1, 4):
                while asyncio.run(server_call(server.url)) == 0:  # wait until something decodes
                    time.sleep(0.01)
                time.sleep(0.05)
                ctl.pause_generation()
                asyncio.run(server_call(server.url, version))
                ctl.resume_generation(version)
                trained += [(version, t) for t in ctl.get_batch(timeout=120)]
            metrics = ctl.metrics()
    for version, t in trained:
        assert len(t.output_ids) == len(t.output_logprobs) == len(t.output_versions) > 0
        assert t.output_versions == sorted(t.output_versions) and all(lp <= 0 for lp in t.output_logprobs)
        assert t.start_version <= t.output_versions[0] and version - t.start_version <= 1
    crossed = [t for _, t in trained if len(set(t.output_versions)) > 1]
    assert crossed, "no sample was decoded across an update"
    assert all(t.interruptions >= 1 for t in crossed)
    assert metrics["perf/gen_tokens_per_s"] > 0


def test_server_dropped_by_the_weight_path_gets_no_more_rollouts():
    """One fleet: a server the weight path drops (``drop_server``, called while the fleet is paused
    for an update) is never routed to again, though it still answers health probes."""
    fleet = FakeFleet([FakeServer(seed=i, token_delay=(0.001, 0.002)) for i in range(2)])
    dropped = fleet.servers[1]
    try:
        ctl = make_controller(fleet, ListPrompts(10_000), eta=1)
        with ctl:
            for version in (1, 2, 3, 4):
                ctl.get_batch(timeout=60)
                ctl.pause_generation(pause_servers=False)
                fleet.update_behind_controllers_back(version)
                if version == 1:
                    ctl.drop_server(dropped.url, "did not take weights v1")
                ctl.resume_generation(version, resume_servers=False)
            assert ctl.metrics()["rollout/healthy_servers"] == 1.0
        # a request already on its way at the drop arrives at version 1; none may arrive later
        assert dropped.requests and max(r["version"] for r in dropped.requests) <= 1
        assert max(r["version"] for r in fleet.servers[0].requests) == 4
    finally:
        fleet.close()
