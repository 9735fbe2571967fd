"""The decoupled-PPO objective (AReaL, arXiv 2505.24298, Eq. 5). Pure tensor code.

Three policies meet per token: ``pi_behav`` produced the token (its logprob came back from the
rollout server), ``pi_prox`` is the trainer's weights before this step (recomputed without
gradient), ``pi_theta`` is being optimised. The trust region is centred on ``pi_prox``; the
off-policy correction ``w = pi_prox / pi_behav`` re-weights each token without gradient. The
optional corrections of ``w`` (MIS, TIS, icepop-style and sequence-level masks) are defined, with
their formulas, in ``megatron_areal.algorithm.offpolicy``.
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_areal.algorithm.offpolicy import behaviour_correction


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_weight_cap: float | None = None,
    loss_scale_tokens: float | None = None,
    *,
    behav_imp_weight_mode: Literal["mask", "truncate"] = "mask",
    behav_imp_weight_low: float | None = None,
    seq_imp_weight_low: float | None = None,
    seq_imp_weight_high: float | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negated decoupled-PPO objective, summed over tokens, divided by the loss-mask token count.

    All tensors share one shape (packed 1-D or [batch, tokens]). ``loss_mask`` is bool or 0/1.
    Tokens whose behaviour importance weight exceeds ``behav_imp_weight_cap`` are dropped from
    the sum but still count in the denominator, so dropping never inflates the other tokens.
    ``loss_scale_tokens`` replaces that denominator when a batch is split into micro-batches or
    across data-parallel ranks: pass the token count of the whole mini-batch so the per-piece
    losses add up to the mini-batch mean.

    The keyword-only corrections (``megatron_areal.algorithm.offpolicy``; their defaults give the
    behaviour above): ``behav_imp_weight_mode="truncate"`` keeps every token with weight
    ``min(w, behav_imp_weight_cap)`` (TIS) instead of dropping (MIS); ``behav_imp_weight_low``
    also drops tokens with ``w`` below it (icepop-style two-sided mask); ``seq_imp_weight_low`` /
    ``seq_imp_weight_high`` drop whole sequences whose geometric-mean ``w`` over their loss tokens
    is outside the bounds. Sequences are the rows of a 2-D batch; a packed 1-D batch passes
    ``seq_ids``, the sequence index of every position.
    Statistics add ``truncated_tokens`` and ``dropped_sequences`` to those listed in DESIGN.md.
    """
    shapes = {t.shape for t in (logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"decoupled_ppo_loss: all inputs must share one shape, got {sorted(map(tuple, shapes))}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    mask = loss_mask.to(torch.bool)
    proximal_logprobs = proximal_logprobs.detach()
    behavior_logprobs = behavior_logprobs.detach()
    advantages = advantages.detach()

    ratio = torch.exp(logprobs - proximal_logprobs)  # u: current vs proximal
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    # w = pi_prox / pi_behav without gradient (inputs detached), corrected per offpolicy.py
    weight, keep, behav_weight, correction = behaviour_correction(
        proximal_logprobs, behavior_logprobs, mask, cap=behav_imp_weight_cap, mode=behav_imp_weight_mode,
        low=behav_imp_weight_low, seq_low=seq_imp_weight_low, seq_high=seq_imp_weight_high, seq_ids=seq_ids)
    objective = torch.where(keep, weight * surrogate, torch.zeros_like(surrogate))

    n_mask = int(mask.sum())
    denominator = float(loss_scale_tokens) if loss_scale_tokens is not None else max(n_mask, 1)
    loss = -objective.sum() / denominator

    with torch.no_grad():
        clipped = (ratio * advantages > clipped_ratio * advantages) & keep
        weights = behav_weight[mask]
        stats = {
            "tokens": float(n_mask),
            "clip_fraction": float(clipped.sum()) / max(n_mask, 1),
            "importance_weight_mean": float(weights.mean()) if n_mask else 1.0,
            "importance_weight_max": float(weights.max()) if n_mask else 1.0,
            "dropped_tokens": correction["dropped_tokens"],
            "truncated_tokens": correction["truncated_tokens"],
            "dropped_sequences": correction["dropped_sequences"],
            "ratio_mean": float(ratio[mask].mean()) if n_mask else 1.0,
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate k3 = exp(r) - 1 - r with r = ref - theta.

    Non-negative, unbiased, and low-variance for samples drawn from pi_theta (Schulman, 2020).
    """
    log_ratio = ref_logprobs.detach() - logprobs
    return torch.exp(log_ratio) - 1.0 - log_ratio
