"""Turn trajectories into per-position training arrays, and reduce PPO statistics.

Per-position arrays have L - 1 entries per sequence (position t predicts token t + 1), the layout
of ``Trajectory.loss_mask`` / ``Trajectory.behavior_logprobs``. Every rank receives the same full
trajectory list, so batch-wide quantities (advantages, token counts, whitening statistics) are
computed locally without communication.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_areal.algorithm import group_advantages, normalize_advantages
from megatron_areal.rollout.trajectory import Trajectory


def check_trajectories(trajectories: Sequence[Trajectory], max_seq_len: int) -> None:
    """Clear errors for records the trainer cannot use, naming the trajectory index."""
    if not trajectories:
        raise ValueError("ppo_update: no trajectories")
    for i, t in enumerate(trajectories):
        if not t.prompt_ids or not t.output_ids:
            raise ValueError(f"trajectory {i}: needs at least one prompt and one output token "
                             f"(prompt {len(t.prompt_ids)}, output {len(t.output_ids)})")
        if len(t.output_logprobs) != len(t.output_ids):
            raise ValueError(f"trajectory {i}: {len(t.output_logprobs)} output_logprobs for "
                             f"{len(t.output_ids)} output tokens")
        n = len(t.prompt_ids) + len(t.output_ids)
        if n > max_seq_len:
            raise ValueError(f"trajectory {i}: {n} tokens, more than model.max_seq_len={max_seq_len}")


def sequence_advantages(trajectories: Sequence[Trajectory], kind: str) -> list[float]:
    """One advantage per trajectory from its reward relative to its group (same ``group_id``)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        groups[t.group_id].append(i)
    out = [0.0] * len(trajectories)
    sizes = {len(ix) for ix in groups.values()}
    if len(sizes) == 1:  # the common case: one tensor for all groups
        members = list(groups.values())
        rewards = torch.tensor([[trajectories[i].reward for i in ix] for ix in members], dtype=torch.float32)
        adv = group_advantages(rewards, kind)
        for ix, row in zip(members, adv.tolist()):
            for i, a in zip(ix, row):
                out[i] = a
        return out
    for ix in groups.values():  # groups of different sizes (some samples were dropped)
        rewards = torch.tensor([[trajectories[i].reward for i in ix]], dtype=torch.float32)
        for i, a in zip(ix, group_advantages(rewards, kind)[0].tolist()):
            out[i] = a
    return out


def token_advantages(trajectories: Sequence[Trajectory], seq_adv: Sequence[float],
                     normalize: bool) -> list[list[float]]:
    """Each output position carries its trajectory's advantage; optionally whitened batch-wide."""
    per_pos = [[a * m for m in t.loss_mask] for t, a in zip(trajectories, seq_adv)]
    if not normalize:
        return per_pos
    flat = torch.tensor([v for row in per_pos for v in row])
    mask = torch.tensor([m for t in trajectories for m in t.loss_mask], dtype=torch.bool)
    whitened = normalize_advantages(flat, mask, float(mask.sum()), float(flat[mask].sum()),
                                    float((flat[mask] ** 2).sum()))
    out, start = [], 0
    for row in per_pos:
        out.append(whitened[start:start + len(row)].tolist())
        start += len(row)
    return out


class StatsReducer:
    """Token-weighted statistics of one update, summed over micro-batches, then over ranks."""

    SUMS = ("loss", "tokens", "clipped", "iw_sum", "dropped_tokens", "entropy_sum", "kl_sum")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.SUMS, 0.0)
        self.iw_max = 0.0

    def add(self, report: dict[str, float]) -> None:
        for k in self.SUMS:
            self.sums[k] += float(report.get(k, 0.0))
        self.iw_max = max(self.iw_max, float(report.get("iw_max", 0.0)))

    def reduce(self, contributes: bool, groups: Sequence[dist.ProcessGroup],
               device: torch.device) -> dict[str, float]:
        """Sum over ``groups`` in turn; only ranks with ``contributes`` add their numbers once."""
        sums = torch.tensor([self.sums[k] if contributes else 0.0 for k in self.SUMS], dtype=torch.float64,
                            device=device)
        peak = torch.tensor([self.iw_max if contributes else 0.0], dtype=torch.float64, device=device)
        for g in groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(sums, group=g)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=g)
        s = dict(zip(self.SUMS, sums.tolist()))
        n = max(s["tokens"], 1.0)
        return {"loss": s["loss"], "tokens": s["tokens"], "clip_fraction": s["clipped"] / n,
                "importance_weight_mean": s["iw_sum"] / n, "importance_weight_max": float(peak.item()),
                "dropped_tokens": s["dropped_tokens"], "entropy": s["entropy_sum"] / n, "kl": s["kl_sum"] / n}
