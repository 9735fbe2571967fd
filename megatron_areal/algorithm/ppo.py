"""The decoupled-PPO objective (AReaL, arXiv 2505.24298, Eq. 5). Pure tensor code.

Three policies meet per token: ``pi_behav`` produced the token (its logprob came back from the
rollout server), ``pi_prox`` is the trainer's weights before this step (recomputed without
gradient), ``pi_theta`` is being optimised. The trust region is centred on ``pi_prox``; the
off-policy correction ``w = pi_prox / pi_behav`` re-weights each token without gradient.
"""
from __future__ import annotations

import torch


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negated decoupled-PPO objective, summed over tokens, divided by the loss-mask token count.

    All tensors share one shape (packed 1-D or [batch, tokens]). ``loss_mask`` is bool or 0/1.
    Tokens whose behaviour importance weight exceeds ``behav_imp_weight_cap`` are dropped from
    the sum but still count in the denominator, so dropping never inflates the other tokens.
    ``loss_scale_tokens`` replaces that denominator when a batch is split into micro-batches or
    across data-parallel ranks: pass the token count of the whole mini-batch so the per-piece
    losses add up to the mini-batch mean.
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
    behav_weight = torch.exp(proximal_logprobs - behavior_logprobs)  # w: no gradient (inputs detached)

    keep = mask
    if behav_imp_weight_cap is not None:
        keep = mask & (behav_weight <= behav_imp_weight_cap)
    objective = torch.where(keep, behav_weight * surrogate, torch.zeros_like(surrogate))

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
            "dropped_tokens": float((mask & ~keep).sum()),
            "ratio_mean": float(ratio[mask].mean()) if n_mask else 1.0,
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate k3 = exp(r) - 1 - r with r = ref - theta.

    Non-negative, unbiased, and low-variance for samples drawn from pi_theta (Schulman, 2020).
    """
    log_ratio = ref_logprobs.detach() - logprobs
    return torch.exp(log_ratio) - 1.0 - log_ratio
