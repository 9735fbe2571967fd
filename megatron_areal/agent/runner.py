"""Episodes on the rollout loop: a group's ``group_size`` episodes of one prompt, run side by side.

Each episode gets its own session on the ``AgentEndpoint`` and a real ``openai.AsyncOpenAI`` client
pointed at it; the agent's completions go through the loop's ``generate`` (interruptible, routed,
with per-token versions), so a weight push in the middle of an episode pauses and resumes its
current completion like any sample. When the agent returns (or fails: ``workflow.run_bounded``), the
session is closed and its turns become trajectories (``to_trajectories``).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_areal.agent.endpoint import AgentEndpoint, Generate
from megatron_areal.agent.render import ChatRenderer
from megatron_areal.agent.session import EpisodeSession
from megatron_areal.agent.to_trajectories import episode_trajectories
from megatron_areal.agent.workflow import AgentFn, AgentTask, EpisodeOutcome, run_bounded
from megatron_areal.records import Trajectory
from megatron_areal.rollout.sources import PromptLike

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode: completions, tokens of any sequence, tokens per completion, wall time."""

    max_turns: int = 8
    max_tokens: int = 1024  # prompt + replies of one trajectory (at most the model's max_seq_len)
    max_new_tokens: int = 64  # per completion
    timeout_s: float = 600.0


def openai_client(base_url: str, timeout_s: float) -> Any:
    """The real ``openai.AsyncOpenAI`` pointed at one episode (no retries: a refused turn is final)."""
    try:
        import openai
    except ImportError:
        raise RuntimeError("rollout.workflow needs the openai package: pip install openai") from None
    return openai.AsyncOpenAI(base_url=base_url, api_key="episode", max_retries=0, timeout=timeout_s)


def agent_task(prompt: PromptLike) -> AgentTask:
    """The task an agent sees for ``prompt`` (its chat messages, gold answer, index and task name)."""
    as_messages: Callable[[], list[dict[str, Any]]] | None = getattr(prompt, "as_messages", None)
    messages = as_messages() if as_messages is not None else []
    return AgentTask(index=prompt.index, messages=messages, answer=prompt.reward_answer(), task=prompt.task)


class EpisodeRunner:
    """Runs the agent's episodes for the rollout loop and keeps their figures."""

    def __init__(self, agent: AgentFn, renderer: ChatRenderer, limits: EpisodeLimits) -> None:
        self.agent, self.limits = agent, limits
        self.endpoint = AgentEndpoint(renderer)
        self.counters = collections.Counter[str]()
        self._info_sums = collections.Counter[str]()
        self._started: asyncio.Lock | None = None
        self._next = 0

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.Lock()
        async with self._started:
            if not self.endpoint.url:
                await self.endpoint.start()

    async def close(self) -> None:
        await self.endpoint.close()

    async def run_episode(self, task: AgentTask, generate: Generate,
                          label: str) -> tuple[EpisodeSession, EpisodeOutcome]:
        """One episode of ``task``: its session (the turns) and how it ended."""
        await self._ensure_started()
        self._next += 1
        session = EpisodeSession(episode_id=f"{label}-{self._next}", max_turns=self.limits.max_turns,
                                 max_tokens=self.limits.max_tokens, max_new_tokens=self.limits.max_new_tokens)
        client = openai_client(self.endpoint.open(session, generate), self.limits.timeout_s)
        try:
            outcome = await run_bounded(self.agent, task, client, self.limits.timeout_s)
        finally:
            self.endpoint.close_episode(session.episode_id, "agent returned")
            await client.close()
        if outcome.failure:
            log.warning("episode %s (prompt %d) ends with reward 0: the agent %s", session.episode_id,
                        task.index, outcome.failure)
        return session, outcome

    async def run_group(self, gid: int, prompt: PromptLike, version: int, generate: Generate,
                        group_size: int) -> list[Trajectory]:
        """``group_size`` episodes of ``prompt`` -> their trajectories (all with ``group_id = gid``; those of
        the i-th episode with ``episode = i``, so that an episode split into several counts once)."""
        task = agent_task(prompt)
        episodes = await asyncio.gather(*(self.run_episode(task, generate, f"g{gid}e{i}")
                                          for i in range(group_size)))
        out: list[Trajectory] = []
        for i, (session, outcome) in enumerate(episodes):
            trajectories, shape = episode_trajectories(
                session.turns, start_version=version, reward=outcome.reward, group_id=gid, episode=i,
                prompt_index=prompt.index, answer=task.answer, task=prompt.task)
            out += trajectories
            self._count(session, outcome, shape.trajectories)
        return out

    def _count(self, session: EpisodeSession, outcome: EpisodeOutcome, n_trajectories: int) -> None:
        stats = session.stats()
        c = self.counters
        c["episodes"] += 1
        c["failed"] += bool(outcome.failure)
        c["turns"] += stats["turns"]
        c["later_turns"] += max(stats["turns"] - 1, 0)
        c["extended_turns"] += stats["extended_turns"]
        c["tool_calls"] += stats["tool_calls"]
        c["episodes_with_tool_calls"] += stats["tool_calls"] > 0
        c["malformed_calls"] += stats["malformed_calls"]
        c["trajectories"] += n_trajectories
        c["reward_sum"] += outcome.reward
        for k, v in outcome.info.items():
            self._info_sums[k] += v
        if n_trajectories > 1:
            log.info("episode %s: %d turns became %d trajectories (a turn's prompt did not extend the one "
                     "before: edited history or a template that re-renders earlier turns)",
                     session.episode_id, stats["turns"], n_trajectories)

    def metrics(self) -> dict[str, float]:
        """Episode figures since the last call: failures, turns, tool use, and how often turns extended."""
        c, n = self.counters, max(self.counters["episodes"], 1)
        out = {"agent/episodes": float(c["episodes"]), "agent/failed_fraction": c["failed"] / n,
               "agent/turns_mean": c["turns"] / n, "agent/tool_calls_mean": c["tool_calls"] / n,
               "agent/tool_use_fraction": c["episodes_with_tool_calls"] / n,
               "agent/malformed_calls": float(c["malformed_calls"]),
               "agent/trajectories_per_episode": c["trajectories"] / n,
               "agent/extended_turn_fraction": c["extended_turns"] / max(c["later_turns"], 1),
               "agent/reward_mean": c["reward_sum"] / n}
        out.update({f"agent/{k}": v / n for k, v in self._info_sums.items()})
        self.counters.clear()
        self._info_sums.clear()
        return out
