"""Agent episodes end to end on CPU: the real ``openai`` client over HTTP, the agent endpoint, the
rollout controller, a real embedded server (tiny Llama) with a weight update in the middle, and the
trainer's own logprobs (``convert.score``: the Megatron actor's forward) as the reference for the
server's.

Agents are in ``agent_examples``; each is what a user would write for any OpenAI server.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_fakes import ListPrompts, ParityScorer, decode, encode

from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.runner import EpisodeLimits, EpisodeRunner
from megatron_areal.agent.workflow import load_workflow
from megatron_areal.records import Trajectory
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.controller import RolloutController
from megatron_areal.weights.endpoints import weight_calls

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Any]:
    from megatron_areal.launch.embedded import start_embedded
    with start_embedded(tiny_llama, args=["--max-running", "16"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama)


def make_controller(url: str, tokenizer: Any, agent: str, *, batch: int = 2, group: int = 2,
                    limits: EpisodeLimits | None = None, **kw: Any) -> tuple[RolloutController, EpisodeRunner]:
    runner = EpisodeRunner(load_workflow(f"agent_examples:{agent}"), ChatRenderer(tokenizer),
                           limits or EpisodeLimits(max_turns=4, max_tokens=512, max_new_tokens=8, timeout_s=60))
    cfg = RolloutConfig(batch_size=batch, group_size=group, max_new_tokens=8, max_concurrent=4,
                        filter_equal_rewards=False, temperature=1.0, workflow=f"agent_examples:{agent}", **kw)
    ctl = RolloutController(cfg, StalenessConfig(eta=1), [url], ListPrompts(10_000), encode, decode,
                            ParityScorer(), episodes=runner)
    return ctl, runner


def update_weights(url: str, model: Path, version: int) -> None:
    from megatron_areal.fleet.client import RolloutClient

    async def call() -> None:
        async with RolloutClient(url) as client:
            await weight_calls(client).update_weights_from_disk(str(model), weight_version=str(version))
    asyncio.run(call())


def find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    raise AssertionError("token run not found")


@pytest.fixture(scope="module")
def episodes(server: Any, tokenizer: Any, tiny_llama: Path) -> tuple[list[Trajectory], dict[str, float]]:
    """Two groups of two episodes of ``tool_then_answer``, with a weight update (version 1) as they run."""
    ctl, _ = make_controller(server.url, tokenizer, "tool_then_answer")
    with ctl:
        time.sleep(0.3)  # let the first completions start, so the update interrupts some
        ctl.pause_generation()
        update_weights(server.url, tiny_llama, 1)
        ctl.resume_generation(1)
        batch = ctl.get_batch(timeout=300)
        metrics = ctl.metrics()
    return batch, metrics


def test_each_episode_is_one_sequence_whose_tool_tokens_carry_no_loss(episodes, tokenizer) -> None:
    from agent_examples import POISON
    batch, metrics = episodes
    assert len(batch) == 4 and metrics["agent/episodes"] >= 4  # more may have finished meanwhile
    assert metrics["agent/trajectories_per_episode"] == 1.0 and metrics["agent/extended_turn_fraction"] == 1.0
    assert metrics["agent/turns_mean"] == 2.0
    poison = tokenizer(POISON, add_special_tokens=False)["input_ids"]
    for t in batch:
        mask = t.policy_mask
        assert len(mask) == len(t.output_ids) == len(t.output_logprobs) == len(t.output_versions)
        start = find(t.output_ids, poison)
        assert not any(mask[start:start + len(poison)]), "tool output would be trained"
        # two replies: mask is 1..1 0..0 1..1 (reply, environment, reply)
        runs = [m for k, m in enumerate(mask) if k == 0 or mask[k - 1] != m]
        assert runs == [1, 0, 1], runs
        assert all(lp == 0.0 for lp, m in zip(t.output_logprobs, mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.output_logprobs, mask) if m)
        assert t.start_version == min(v for v, m in zip(t.output_versions, mask) if m) or t.start_version == 0
        assert t.output_versions == sorted(t.output_versions)
    assert {t.start_version for t in batch} == {0}, "every episode started before the update"
    assert any(max(t.output_versions) == 1 for t in batch), "no episode continued under the new weights"


def test_trainer_logprobs_match_the_servers_on_every_trained_token(episodes, tiny_llama) -> None:
    from megatron_areal.algorithm import decoupled_ppo_loss
    from megatron_areal.convert.score import score
    batch, _ = episodes
    trainer = score("hf", tiny_llama, [t.input_ids for t in batch])
    worst = 0.0
    for t, lp in zip(batch, trainer):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        diff = (torch.tensor(lp) - torch.tensor(t.behavior_logprobs))[mask].abs()
        worst = max(worst, float(diff.max()))
    logging.getLogger(__name__).info("max |trainer - server| logprob over trained tokens: %.2e", worst)
    assert worst <= 1e-5, worst
    # The poisoned tool output moves nothing: the loss's gradient is exactly 0 there, while training on
    # every output token (the mask a single-turn recipe would use) would give it weight.
    t, lp = batch[0], torch.tensor(trainer[0], requires_grad=True)
    behaviour, adv = torch.tensor(t.behavior_logprobs), torch.ones(len(t.loss_mask))
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), behaviour, adv, torch.tensor(t.loss_mask))
    loss.backward()
    env = torch.tensor([0] * (len(t.prompt_ids) - 1) + [1 - m for m in t.policy_mask], dtype=torch.bool)
    assert env.any() and torch.all(lp.grad[env] == 0) and torch.all(lp.grad[~env & (lp.grad != 0)] != 0)
    everything = torch.tensor([0] * (len(t.prompt_ids) - 1) + [1] * len(t.output_ids))
    naive = torch.tensor(trainer[0], requires_grad=True)
    decoupled_ppo_loss(naive, naive.detach(), behaviour, adv, everything)[0].backward()
    assert naive.grad[env].abs().sum() > 0


def test_edited_history_makes_one_trajectory_per_turn(server, tokenizer) -> None:
    ctl, _ = make_controller(server.url, tokenizer, "edits_history", batch=1)
    with ctl:
        batch = ctl.get_batch(timeout=300)
        metrics = ctl.metrics()
    assert metrics["agent/extended_turn_fraction"] == 0.0 and metrics["agent/trajectories_per_episode"] == 2.0
    assert len(batch) == 4 and all(t.reward == 1.0 and all(t.policy_mask) for t in batch)
    assert len({t.group_id for t in batch}) == 1


def test_agents_that_raise_hang_or_return_garbage_end_their_episode_with_reward_zero(server, tokenizer,
                                                                                     caplog) -> None:
    """Task index % 4: 0 answers, 1 raises, 2 hangs past the episode timeout, 3 returns a string."""
    limits = EpisodeLimits(max_turns=4, max_tokens=512, max_new_tokens=4, timeout_s=5)
    ctl, _ = make_controller(server.url, tokenizer, "misbehaves", batch=4, group=1, limits=limits)
    rewards: dict[int, set[float]] = {}
    with caplog.at_level(logging.WARNING), ctl:
        while 2 not in rewards:  # the hanging episodes finish last (at their timeout)
            for t in ctl.get_batch(timeout=300):
                rewards.setdefault(t.prompt_index % 4, set()).add(t.reward)
        metrics = ctl.metrics()
    assert rewards == {0: {1.0}, 1: {0.0}, 2: {0.0}, 3: {0.0}}
    assert 0.5 <= metrics["agent/failed_fraction"] < 1.0
    text = caplog.text
    assert "raised KeyError" in text and "timed out after 5 s" in text and "not a finite reward" in text


def test_max_turns_ends_an_agent_that_never_stops(server, tokenizer, caplog) -> None:
    limits = EpisodeLimits(max_turns=3, max_tokens=512, max_new_tokens=2, timeout_s=60)
    ctl, _ = make_controller(server.url, tokenizer, "never_stops", batch=1, group=1, limits=limits)
    with caplog.at_level(logging.WARNING), ctl:
        batch = ctl.get_batch(timeout=300)
        metrics = ctl.metrics()
    assert metrics["agent/turns_mean"] == 3.0 and batch[0].reward == 0.0
    assert "max_turns=3 reached" in caplog.text


def test_endpoint_answers_the_openai_client_and_refuses_what_it_cannot_do(server, tokenizer) -> None:
    """Streaming, n > 1 and an unknown episode are refused with errors the client raises as such."""
    import openai

    from megatron_areal.agent.endpoint import AgentEndpoint
    from megatron_areal.agent.session import EpisodeSession
    from megatron_areal.rollout.request import SampleOutput

    async def generate(ids: list[int], max_new: int, key: str) -> SampleOutput:
        return SampleOutput(output_ids=tokenizer("ok<|im_end|>", add_special_tokens=False)["input_ids"],
                            output_logprobs=[-0.5] * 3, output_versions=[0] * 3, finish_reason="stop")

    async def drive() -> list[str]:
        endpoint = AgentEndpoint(ChatRenderer(tokenizer))
        await endpoint.start()
        session = EpisodeSession(episode_id="e1", max_turns=2, max_tokens=256, max_new_tokens=8)
        url = endpoint.open(session, generate)
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model="policy", messages=msgs)
        out = [reply.choices[0].message.content, reply.choices[0].finish_reason, str(reply.usage.completion_tokens)]
        for kw in ({"stream": True}, {"n": 2}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="policy", messages=msgs, **kw)
            out.append(e.value.message)
        lost = openai.AsyncOpenAI(base_url=url.replace("e1", "nope"), api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await lost.chat.completions.create(model="policy", messages=msgs)
        await client.close()
        await lost.close()
        await endpoint.close()
        return out

    out = asyncio.run(drive())
    assert out[:3] == ["ok", "stop", "3"]
    assert "stream" in out[3] and "n=1" in out[4]
