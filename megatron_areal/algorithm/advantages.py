"""Group-relative advantages for outcome rewards. Pure tensor code.

``rewards`` is ``[n_groups, group_size]``: the samples of one prompt form a group, and each
sample's advantage is its reward relative to its group.
"""
from __future__ import annotations

import torch

ADVANTAGE_KINDS = ("grpo", "drgrpo", "rloo")


def group_advantages(rewards: torch.Tensor, kind: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """``grpo``: (r - group mean) / group std; ``drgrpo``: r - group mean (Dr. GRPO drops the std);
    ``rloo``: r - mean of the other samples of the group (leave-one-out baseline)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    n = rewards.shape[1]
    mean = rewards.mean(dim=1, keepdim=True)
    if kind == "grpo":
        std = rewards.std(dim=1, keepdim=True, unbiased=False) if n > 1 else torch.zeros_like(mean)
        return (rewards - mean) / (std + eps)
    if kind == "drgrpo":
        return rewards - mean
    if kind == "rloo":
        if n < 2:
            raise ValueError("rloo needs group_size >= 2")
        others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
        return rewards - others_mean
    raise ValueError(f"unknown advantage kind {kind!r}; choose one of {', '.join(ADVANTAGE_KINDS)}")


def normalize_advantages(advantages: torch.Tensor, mask: torch.Tensor, count: float, total: float,
                         total_sq: float, eps: float = 1e-6) -> torch.Tensor:
    """Whiten token advantages with batch statistics that the caller reduced over all DP ranks.

    ``count``, ``total`` and ``total_sq`` are the sums of 1, A and A^2 over masked tokens of the
    whole batch; keeping the reduction outside keeps this function free of process groups.
    """
    mean = total / max(count, 1.0)
    var = max(total_sq / max(count, 1.0) - mean * mean, 0.0)
    return torch.where(mask.to(torch.bool), (advantages - mean) / (var**0.5 + eps), torch.zeros_like(advantages))
