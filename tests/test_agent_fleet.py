"""Agent episodes at scale and on the SGLang path.

- 256 episodes in flight on test servers (``rollout_fakes``: random latencies and lengths, tokens
  that encode the weight version), with weight pushes between training batches: every episode ends
  exactly once (trained once, or cancelled when the run stops), none is lost or duplicated.
- The ``/generate`` bodies the endpoint's completions send validate against SGLang 0.5.23's own
  request classes (``sglang_receiver``), and a later turn's body carries the earlier turn's ids.
"""
from __future__ import annotations

import collections
from typing import Any

import pytest
from agent_examples import Census
from rollout_fakes import FakeFleet, FakeServer, ListPrompts, ParityScorer, decode, encode

from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.runner import EpisodeLimits, EpisodeRunner
from megatron_areal.agent.workflow import load_workflow
from megatron_areal.model.assets import tiny_tokenizer
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.controller import RolloutController

pytestmark = pytest.mark.timeout(600)
ETA = 4
STEPS = 8  # the first 4 batches are the 256 held episodes; later ones start between pushes


def controller(urls: list[str], agent: str, *, batch: int, group: int, concurrent: int) -> RolloutController:
    runner = EpisodeRunner(load_workflow(f"agent_examples:{agent}"), ChatRenderer(tiny_tokenizer()),
                           EpisodeLimits(max_turns=4, max_tokens=4096, max_new_tokens=8, timeout_s=300))
    cfg = RolloutConfig(batch_size=batch, group_size=group, max_new_tokens=8, max_concurrent=concurrent,
                        filter_equal_rewards=False, workflow=f"agent_examples:{agent}")
    return RolloutController(cfg, StalenessConfig(eta=ETA), urls, ListPrompts(100_000), encode, decode,
                             ParityScorer(), episodes=runner)


def test_256_episodes_in_flight_across_weight_pushes_each_end_exactly_once() -> None:
    fleet = FakeFleet([FakeServer(seed=s, stop_prob=0.2, token_delay=(0.005, 0.02)) for s in range(2)])
    ctl = controller(fleet.urls, "counted", batch=16, group=4, concurrent=64)  # 64 groups x 4 = 256 episodes
    Census.hold_until = 256
    trained: list[tuple[int, Any]] = []
    ended = 0
    try:
        with ctl:
            for version in range(1, STEPS + 1):
                trained += [(version - 1, t) for t in ctl.get_batch(timeout=300)]
                ctl.pause_generation()
                fleet.set_version(version)
                ctl.resume_generation(version)
                ended += int(ctl.metrics()["agent/episodes"])
    finally:
        fleet.close()
    assert Census.peak == 256, Census.peak
    assert Census.inflight == 0 and Census.started == Census.returned + Census.cancelled
    assert Census.returned >= ended >= len(trained) == STEPS * 16 * 4
    per_group = collections.Counter(t.group_id for _, t in trained)
    assert set(per_group.values()) == {4}, "a group lost or repeated an episode"
    for version, t in trained:
        policy = [v for v, m in zip(t.output_versions, t.policy_mask) if m]
        assert version - t.start_version <= ETA and t.start_version == min(policy + [t.start_version])
        # the fake servers' tokens carry the version that produced them
        assert all(tok // 1000 == v for tok, v, m in zip(t.output_ids, t.output_versions, t.policy_mask) if m)
    assert any(len(set(t.output_versions)) > 1 for _, t in trained), "no episode spanned a weight push"


def test_every_generate_body_of_an_episode_is_a_valid_sglang_request() -> None:
    from test_sglang_conformance import start_receivers

    receiver = start_receivers(1)[0]
    try:
        Census.hold_until = 0
        ctl = controller([receiver.url], "counted", batch=1, group=2, concurrent=1)
        with ctl:
            batch = ctl.get_batch(timeout=120)
            metrics = ctl.metrics()
        bodies = [e["body"] for e in receiver.get("/received")["received"] if e["path"] == "/generate"]
    finally:
        receiver.stop()
    assert metrics["agent/failed_fraction"] == 0.0 and len(batch) == 2
    assert len(bodies) >= 4 and all(b["return_logprob"] is True for b in bodies)
    by_prompt = {tuple(b["input_ids"]): b for b in bodies}
    for t in batch:  # the second turn's body holds the first turn's prompt and reply, token for token
        assert tuple(t.input_ids[:len(t.input_ids) - 3]) in by_prompt
