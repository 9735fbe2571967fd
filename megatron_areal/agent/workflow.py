"""The user's agent: ``rollout.workflow: pkg.module:run_episode``, loaded and run with bounds.

    async def run_episode(task: AgentTask, client: openai.AsyncOpenAI) -> float | EpisodeResult

An agent may return a reward, or an ``EpisodeResult`` (a reward and the statistics it wants logged).
Anything else ends the episode with reward 0: an exception, a hang past ``episode_timeout_s``, a
return value that is not a finite number. The reason is logged and counted; the run goes on.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentTask:
    """What an agent is given: the prompt's messages, the gold answer, its dataset index and task name."""

    index: int
    messages: list[dict[str, Any]]
    answer: Any = None
    task: str = ""


@dataclass(frozen=True)
class EpisodeResult:
    """An agent's reward and, optionally, figures it wants averaged into the rollout metrics."""

    reward: float
    info: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeOutcome:
    """How an episode ended: its reward, and ``failure`` (empty when the agent returned normally)."""

    reward: float
    failure: str = ""
    info: dict[str, float] = field(default_factory=dict)


AgentFn = Callable[[AgentTask, Any], Awaitable[Any]]


class WorkflowError(ValueError):
    """``rollout.workflow`` does not name an async function; the message says what is wrong."""


def load_workflow(spec: str) -> AgentFn:
    """The async function ``spec`` (``pkg.module:function``) names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise WorkflowError(f"rollout.workflow: expected 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise WorkflowError(f"rollout.workflow: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise WorkflowError(f"rollout.workflow: {module_name!r} has no {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise WorkflowError(f"rollout.workflow: {spec} must be an async function (async def {attr}(task, client))")
    return fn


def _reward(value: Any) -> EpisodeOutcome:
    if isinstance(value, EpisodeResult):
        info = {k: float(v) for k, v in value.info.items() if isinstance(v, (int, float))}
        value, extra = value.reward, info
    else:
        extra = {}
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return EpisodeOutcome(0.0, f"returned {type(value).__name__} {str(value)[:80]!r}, not a finite reward")
    return EpisodeOutcome(float(value), info=extra)


async def run_bounded(agent: AgentFn, task: AgentTask, client: Any, timeout_s: float) -> EpisodeOutcome:
    """Run one episode; whatever the agent does, an outcome comes back (never an exception but
    cancellation)."""
    try:
        value = await asyncio.wait_for(agent(task, client), timeout_s)
    except TimeoutError:
        return EpisodeOutcome(0.0, f"timed out after {timeout_s:.0f} s")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the agent is user code: any failure ends its episode only
        return EpisodeOutcome(0.0, f"raised {type(e).__name__}: {str(e)[:300]}")
    return _reward(value)
