"""Learning goes the right way: one PPO step of the real Megatron actor raises the logprobs of
positive-advantage tokens and lowers those of negative-advantage tokens.

The layout tests compare one layout with another, so a sign flip of the loss or of the advantages
would pass them; this one fails on either. The reference is the definition of policy improvement:
after a step on the objective ``A * ratio``, a trajectory's tokens become more likely when its
advantage is positive and less likely when it is negative. Behaviour logprobs are the actor's own
(on-policy: every importance weight is 1, nothing is clipped or dropped), the rewards split each
group in half, and the output tokens of different trajectories barely overlap, so each
trajectory's mean logprob change must carry the sign of its advantage.

Cases: decoupled PPO with one mini-batch (the shortcut where the training forward gives pi_prox),
with two mini-batches (a separate proximal forward, two optimizer steps), and naive PPO.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from test_actor_parallel import ARCHS, Group

pytestmark = pytest.mark.timeout(300)

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # two groups of four, half right in each
TEMPERATURE = 1.0
MIN_SHIFT = 0.02  # nats: a trajectory's mean logprob change; one Adam step at lr 1e-3 moves it about 0.2


def _trajectories(behaviour: list[list[float]] | None = None) -> list[Any]:
    from megatron_areal.records import Trajectory

    g = torch.Generator().manual_seed(1)
    out = []
    for i, reward in enumerate(REWARDS):
        prompt = torch.randint(0, 500, (4,), generator=g).tolist()
        output = torch.randint(0, 500, (6 + i,), generator=g).tolist()
        logprobs = behaviour[i][len(prompt) - 1:] if behaviour else [0.0] * len(output)
        out.append(Trajectory(prompt_ids=prompt, output_ids=output, output_logprobs=list(logprobs),
                              group_id=i // 4, reward=reward))
    return out


def case_step(n_minibatches: int, decoupled: bool) -> dict[str, Any]:
    """Per trajectory: mean logprob change of its output tokens over one ``ppo_update``."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.actor.ppo_batch import sequence_advantages
    from megatron_areal.algorithm.config import PPOConfig

    groups = init_parallel(1, 1, seed=5, backend="gloo")
    actor = Actor(ARCHS["llama"], ModelConfig(max_seq_len=40, dtype="float32"),
                  ParallelConfig(tp=1, pp=1, max_tokens_per_mb=64),
                  OptimizerConfig(lr=1e-3, adam_eps=1e-8, clip_grad=1.0, distributed=False),
                  PPOConfig(n_minibatches=n_minibatches, decoupled=decoupled), groups, seed=5, total_steps=2)
    seqs = [t.input_ids for t in _trajectories()]
    before = [lp.tolist() for lp in actor.compute_logprobs(seqs, TEMPERATURE)]
    trajs = _trajectories(before)  # on-policy: the behaviour logprobs are the actor's own
    stats = actor.ppo_update(trajs, TEMPERATURE)
    after = [lp.tolist() for lp in actor.compute_logprobs(seqs, TEMPERATURE)]
    teardown_parallel()
    shifts = []
    for t, b, a in zip(trajs, before, after):
        k = len(t.prompt_ids) - 1
        shifts.append(sum(y - x for x, y in zip(b[k:], a[k:])) / len(t.output_ids))
    return {"advantages": sequence_advantages(trajs, "grpo"), "shifts": shifts, "stats": stats}


@pytest.fixture(scope="module")
def one():
    group = Group(1)
    yield group
    group.close()


@pytest.mark.parametrize("n_minibatches,decoupled", [(1, True), (2, True), (1, False)],
                         ids=["one_minibatch", "two_minibatches", "naive_ppo"])
def test_ppo_step_moves_logprobs_with_the_advantage(one, n_minibatches, decoupled):
    one.submit(case_step, n_minibatches=n_minibatches, decoupled=decoupled)
    got = one.collect()[0]
    assert got["stats"]["dropped_tokens"] == 0 and got["stats"]["importance_weight_max"] == pytest.approx(1.0)
    rows = [f"advantage {a:+.2f}  mean logprob change {s:+.4f}" for a, s in zip(got["advantages"], got["shifts"])]
    report = "\n".join(rows)
    for a, s in zip(got["advantages"], got["shifts"]):
        assert a != 0
        if a > 0:
            assert s > MIN_SHIFT, f"a positive-advantage trajectory became less likely:\n{report}"
        else:
            assert s < -MIN_SHIFT, f"a negative-advantage trajectory became more likely:\n{report}"
