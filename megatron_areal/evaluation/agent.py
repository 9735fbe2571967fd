"""Held-out success of an agent: its episodes with greedy completions on the fleet's servers.

Each held-out prompt is played once by the agent (``rollout.workflow``) through its own endpoint;
completions are greedy and go to the fleet's members in turn. Success is the fraction of episodes
with reward >= 1, tool use the fraction in which the model made at least one tool call.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from megatron_areal.agent.from_config import episode_limits
from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.runner import EpisodeLimits, EpisodeRunner, agent_task
from megatron_areal.agent.workflow import AgentFn, load_workflow
from megatron_areal.fleet.client import ServerError
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.rollout.config import RolloutConfig
from megatron_areal.rollout.request import SampleError, SampleOutput, VersionParser


@dataclass(frozen=True)
class AgentEvalResult:
    accuracy: float  # episodes with reward >= 1
    tool_use: float  # episodes with at least one tool call
    n: int
    turns_mean: float
    failed: int  # episodes whose agent raised, hung or returned garbage
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        return {"eval/accuracy": self.accuracy, "eval/tool_use": self.tool_use, "eval/turns_mean": self.turns_mean}


def greedy_generate(clients: list[Any], stop_token_ids: list[int]) -> Any:
    """A ``Generate`` on the given rollout clients, round robin, temperature 0."""
    parse = VersionParser(0)
    counter = iter(range(1 << 62))

    async def generate(prompt_ids: list[int], max_new_tokens: int, key: str) -> SampleOutput:
        client = clients[next(counter) % len(clients)]
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids}
        try:
            result = await client.generate(prompt_ids, params)
        except ServerError as e:  # the agent is told the completion failed; the evaluation goes on
            raise SampleError(str(e)) from e
        return SampleOutput(output_ids=result.output_ids, output_logprobs=result.output_logprobs,
                            output_versions=[parse(v) for v in result.output_versions],
                            finish_reason=result.finish_reason)
    return generate


async def evaluate_agent(agent: AgentFn, renderer: Any, limits: EpisodeLimits, prompts: list[Any],
                         clients: list[Any], concurrency: int = 32) -> AgentEvalResult:
    """Play every prompt once (on the running loop, where ``clients`` live)."""
    start = time.monotonic()
    runner = EpisodeRunner(agent, renderer, limits)
    generate = greedy_generate(clients, [renderer.eos_id])
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: Any) -> tuple[float, int, int, bool]:
        async with limit:
            session, outcome = await runner.run_episode(agent_task(prompt), generate, f"eval{prompt.index}")
        stats = session.stats()
        return outcome.reward, stats["tool_calls"], stats["turns"], bool(outcome.failure)

    try:
        results = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await runner.close()
    n = max(len(results), 1)
    return AgentEvalResult(accuracy=sum(r >= 1.0 for r, *_ in results) / n,
                           tool_use=sum(c > 0 for _, c, _, _ in results) / n,
                           n=len(results), turns_mean=sum(t for _, _, t, _ in results) / n,
                           failed=sum(f for *_, f in results), seconds=time.monotonic() - start)


def evaluate_episodes(fleet: Fleet, rollout: RolloutConfig, tokenizer: Any, prompts: list[Any],
                      max_seq_len: int) -> AgentEvalResult:
    """Held-out success and tool use of the agent, greedy, on the fleet's members (from a plain thread)."""
    clients = [slot.client for slot in fleet.routing.slots]
    return fleet.run(evaluate_agent(load_workflow(rollout.workflow), ChatRenderer(tokenizer),
                                    episode_limits(rollout, max_seq_len), prompts, clients))
