"""The agent parts of a run, built from its ``rollout`` section (the trainer's rank 0 calls these)."""
from __future__ import annotations

from typing import Any

from megatron_areal.agent.evaluate import AgentEvalResult, evaluate_agent
from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.runner import EpisodeLimits, EpisodeRunner
from megatron_areal.agent.workflow import load_workflow
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.rollout.config import RolloutConfig


def episode_limits(rollout: RolloutConfig, max_seq_len: int) -> EpisodeLimits:
    """An episode's bounds: no sequence longer than the trainer can hold."""
    return EpisodeLimits(max_turns=rollout.max_turns, max_tokens=min(rollout.max_episode_tokens, max_seq_len),
                         max_new_tokens=rollout.max_new_tokens, timeout_s=rollout.episode_timeout_s)


def episode_runner(rollout: RolloutConfig, tokenizer: Any, max_seq_len: int) -> EpisodeRunner | None:
    """The rollout loop's episode runner when ``rollout.workflow`` names an agent, else None."""
    if not rollout.workflow:
        return None
    return EpisodeRunner(load_workflow(rollout.workflow), ChatRenderer(tokenizer), episode_limits(rollout, max_seq_len))


def evaluate_episodes(fleet: Fleet, rollout: RolloutConfig, tokenizer: Any, prompts: list[Any],
                      max_seq_len: int) -> AgentEvalResult:
    """Held-out success and tool use of the agent, greedy, on the fleet's members (from a plain thread)."""
    clients = [slot.client for slot in fleet.routing.slots]
    return fleet.run(evaluate_agent(load_workflow(rollout.workflow), ChatRenderer(tokenizer),
                                    episode_limits(rollout, max_seq_len), prompts, clients))
