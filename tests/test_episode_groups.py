"""An agent episode that became several trajectories still counts once: in its group's advantages,
in the all-equal-rewards filter and in the rollout metrics; and the response length counts the
policy's tokens, not the environment's.

The split episodes come from the real ``EpisodeRunner`` (its endpoint, the ``openai`` client, the
chat renderer) with a local ``generate`` in place of a server; the references are the advantages of
the same rewards with one entry per episode (``group_advantages``) and hand-counted tokens.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from rollout_fakes import ListPrompt

from megatron_areal.actor.ppo_batch import sequence_advantages
from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.runner import EpisodeLimits, EpisodeRunner
from megatron_areal.agent.session import Turn
from megatron_areal.agent.to_trajectories import episode_trajectories
from megatron_areal.algorithm import group_advantages
from megatron_areal.model.assets import tiny_tokenizer
from megatron_areal.records import Group, Trajectory
from megatron_areal.rollout.buffer import PutResult, ReplayBuffer
from megatron_areal.rollout.metrics import batch_stats
from megatron_areal.rollout.request import SampleOutput

pytestmark = pytest.mark.timeout(120)


async def answers_once(client: Any) -> float:
    messages = [{"role": "user", "content": "Say hi."}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return 1.0


async def edits_its_history_twice(client: Any) -> float:
    """Three completions, each after rewriting the reply before it: three trajectories of one episode."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages[-1]["content"] = "Let me start over."
        messages.append({"role": "user", "content": "Again?"})
    return 0.0


def run_group(rewards_by_behaviour: list[str], group_id: int = 5) -> list[Trajectory]:
    """One group of episodes through the real runner; episode i behaves as ``rewards_by_behaviour[i]``
    (episodes are started in order, so the i-th agent call is episode i)."""
    tok = tiny_tokenizer()
    plan = list(rewards_by_behaviour)

    async def agent(task: Any, client: Any) -> float:
        return await (answers_once if plan.pop(0) == "once" else edits_its_history_twice)(client)

    async def generate(prompt_ids: list[int], max_new_tokens: int, key: str) -> SampleOutput:
        ids = tok.encode("hi", add_special_tokens=False)[:max_new_tokens - 1] + [tok.eos_token_id]
        return SampleOutput(output_ids=ids, output_logprobs=[-0.5] * len(ids), output_versions=[0] * len(ids),
                            finish_reason="stop")

    async def main() -> list[Trajectory]:
        runner = EpisodeRunner(agent, ChatRenderer(tok), EpisodeLimits(max_turns=4, max_tokens=512,
                                                                       max_new_tokens=4, timeout_s=60))
        try:
            return await runner.run_group(group_id, ListPrompt(index=3, text="", answer=None), 0, generate,
                                          len(rewards_by_behaviour))
        finally:
            await runner.close()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def split_group() -> list[Trajectory]:
    """Two episodes of one prompt: reward 1 in one trajectory, reward 0 split into three."""
    return run_group(["once", "split"])


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_a_split_episode_counts_once_in_its_group_advantages(split_group: list[Trajectory], kind: str) -> None:
    assert sorted(t.reward for t in split_group) == [0.0, 0.0, 0.0, 1.0]  # the runner split the 0 episode
    per_episode = group_advantages(torch.tensor([[1.0, 0.0]]), kind)[0].tolist()
    expected = [per_episode[0] if t.reward == 1.0 else per_episode[1] for t in split_group]
    assert sequence_advantages(split_group, kind) == pytest.approx(expected)
    assert len({t.episode for t in split_group}) == 2 and min(t.episode for t in split_group) >= 0


def test_group_members_of_different_groups_and_sizes_keep_their_own_episodes() -> None:
    """A second group of three unsplit episodes beside the split one: groups of 2 and 3 episodes."""
    first, second = run_group(["split", "once"], group_id=1), run_group(["once", "split", "once"], group_id=2)
    batch = second[:2] + first + second[2:]  # interleaved, as a batch may hold them
    adv = sequence_advantages(batch, "grpo")
    two = group_advantages(torch.tensor([[0.0, 1.0]]), "grpo")[0].tolist()
    three = group_advantages(torch.tensor([[1.0, 0.0, 1.0]]), "grpo")[0].tolist()
    expected = [(two if t.group_id == 1 else three)[t.episode] for t in batch]
    assert adv == pytest.approx(expected)


def test_trajectories_without_episode_ids_are_each_a_sample_as_before() -> None:
    """Single-completion samples (and trajectories saved before episode ids existed) are unchanged."""
    rewards = {0: [1.0, 0.0, 0.0], 1: [0.5, 0.25, 1.0], 2: [0.0, 1.0]}
    trajs = [Trajectory(prompt_ids=[1], output_ids=[2], output_logprobs=[0.0], group_id=g, reward=r)
             for g, rs in rewards.items() for r in rs]
    for kind in ("grpo", "drgrpo", "rloo"):
        expected = [a for rs in rewards.values()
                    for a in group_advantages(torch.tensor([rs]), kind)[0].tolist()]
        assert sequence_advantages(trajs, kind) == expected  # bit for bit
    old = trajs[0].to_dict()
    del old["episode"]
    assert Trajectory.from_dict(old).episode == -1


def test_episode_ids_survive_the_buffer_checkpoint(split_group: list[Trajectory]) -> None:
    buf = ReplayBuffer(eta=1)
    buf.put(Group(group_id=5, prompt_index=3, trajectories=split_group), version=0)
    restored = ReplayBuffer(eta=1)
    restored.load_state_dict(buf.state_dict())
    batch, _ = restored.take(version=0, batch_size=1)
    assert [t.episode for t in batch[0].trajectories] == [t.episode for t in split_group]
    assert sequence_advantages(batch[0].trajectories, "grpo") == sequence_advantages(split_group, "grpo")


def test_one_episode_split_in_two_is_filtered_like_one_episode() -> None:
    """With ``filter_equal_rewards``, a group of one episode is kept (as before); split, it is still one."""
    turns = [Turn(prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0], output_versions=[0], extends=False),
             Turn(prompt_ids=[1, 9], output_ids=[4], output_logprobs=[-1.0], output_versions=[0], extends=False)]
    trajs, _ = episode_trajectories(turns, start_version=0, reward=1.0, group_id=0, prompt_index=0, episode=0)
    buf = ReplayBuffer(eta=1, filter_equal_rewards=True)
    assert len(trajs) == 2
    assert buf.put(Group(group_id=0, prompt_index=0, trajectories=trajs), version=0) is PutResult.ACCEPTED


def test_response_length_counts_the_policys_tokens_and_episodes_count_once() -> None:
    t1 = Turn(prompt_ids=[1, 2, 3], output_ids=[10, 11], output_logprobs=[-0.1, -0.1], output_versions=[0, 0],
              extends=False)
    t2 = Turn(prompt_ids=[1, 2, 3, 10, 11, 50, 51, 52], output_ids=[12], output_logprobs=[-0.1],
              output_versions=[0], extends=True)  # 50, 51, 52: a tool result, not the policy's
    [chained], _ = episode_trajectories([t1, t2], start_version=0, reward=1.0, group_id=0, prompt_index=0, episode=0)
    t3 = Turn(prompt_ids=[1, 2, 7], output_ids=[13, 14, 15, 16], output_logprobs=[-0.1] * 4,
              output_versions=[0] * 4, extends=False)
    split, _ = episode_trajectories([t1, t3], start_version=0, reward=0.0, group_id=0, prompt_index=0, episode=1)
    stats = batch_stats([chained, *split], version=0)
    # policy tokens per episode: 2 + 1 = 3 (the chain), 2 + 4 = 6 (the split one); outputs 6 and 6
    assert (stats["rollout/response_len_mean"], stats["rollout/response_len_max"]) == (4.5, 6.0)
    assert stats["rollout/reward_mean"] == 0.5  # one reward per episode, not 1/3
    assert stats["rollout/episode_len_mean"] == 6.0
    plain = [Trajectory(prompt_ids=[1], output_ids=[2] * n, output_logprobs=[0.0] * n, group_id=0, reward=r)
             for n, r in ((3, 1.0), (5, 0.0))]
    stats = batch_stats(plain, version=0)
    assert (stats["rollout/response_len_mean"], stats["rollout/episode_len_mean"]) == (4.0, 4.0)
    assert stats["rollout/reward_mean"] == 0.5
