"""Rollout statistics for TensorBoard.

Per-batch figures (reward, staleness, interruptions, lengths) describe the last batch handed to
the trainer; throughput and idle time cover the wall time since the previous ``metrics()`` call;
counts of dropped, filtered and failed work are cumulative over the run.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_areal.records import Trajectory, episodes


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def batch_stats(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Statistics of one training batch taken at policy ``version``.

    Reward and lengths are per episode (``trajectory.episodes``; a single-completion sample is an
    episode), so an agent episode split into several trajectories counts once. ``response_len``
    counts the tokens the policy generated (``policy_mask``), over all of an episode's turns;
    ``episode_len`` counts every output token, the environment's too (tool results, the template's
    turn headers): for single completions the two are equal. Staleness, interruptions and truncation
    are per trajectory: they belong to each trajectory's own tokens."""
    staleness = [version - t.start_version for t in trajectories]
    members = episodes(trajectories)
    generated = [sum(sum(trajectories[i].policy_mask) for i in ix) for ix in members]
    outputs = [sum(len(trajectories[i].output_ids) for i in ix) for ix in members]
    return {
        "rollout/reward_mean": _mean([trajectories[ix[0]].reward for ix in members]),
        "rollout/staleness_mean": _mean(staleness),
        "rollout/staleness_max": float(max(staleness, default=0)),
        "rollout/interrupted_fraction": _mean([float(t.interruptions > 0) for t in trajectories]),
        "rollout/response_len_mean": _mean(generated),
        "rollout/response_len_max": float(max(generated, default=0)),
        "rollout/episode_len_mean": _mean(outputs),
        "rollout/truncated_fraction": _mean([float(t.finish_reason == "length") for t in trajectories]),
    }


@dataclass
class ThroughputWindow:
    """Generated tokens and fleet busy time between two ``metrics()`` calls."""
    clock: Callable[[], float] = time.monotonic
    tokens: int = 0
    _start: float = 0.0
    _busy_start: float = 0.0

    def __post_init__(self) -> None:
        self._start = self.clock()

    def add_tokens(self, n: int) -> None:
        """Count ``n`` generated tokens in the current window."""
        self.tokens += n

    def roll(self, busy_seconds: float, n_servers: int) -> dict[str, float]:
        """Figures over the window that ends now; ``busy_seconds`` is the fleet's cumulative busy
        time (summed over servers). Starts the next window."""
        now = self.clock()
        elapsed = max(now - self._start, 1e-9)
        busy = busy_seconds - self._busy_start
        stats = {
            "perf/gen_tokens_per_s": self.tokens / elapsed,
            "perf/generator_idle_fraction": min(1.0, max(0.0, 1.0 - busy / (elapsed * n_servers))),
        }
        self._start, self._busy_start, self.tokens = now, busy_seconds, 0
        return stats
