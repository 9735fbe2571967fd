"""The decoupled-PPO objective (AReaL, arXiv 2505.24298, Eq. 5). Pure tensor code.

Three policies meet per token: ``pi_behav`` produced the token (its logprob came back from the
rollout server), ``pi_prox`` is the trainer's weights before this step (recomputed without
gradient), ``pi_theta`` is being optimised. The trust region is centred on ``pi_prox``; the
off-policy correction ``w = pi_prox / pi_behav`` re-weights each token without gradient. The
optional corrections of ``w`` (MIS, TIS, icepop-style and sequence-level masks) are defined, with
their formulas, in ``megatron_areal.algorithm.offpolicy``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from megatron_areal.algorithm.config import PPOConfig
from megatron_areal.algorithm.offpolicy import behaviour_correction


@dataclass(frozen=True, kw_only=True)
class PPOObjective:
    """The decoupled-PPO loss with its clip range and behaviour-weight corrections, built once from the
    ``ppo:`` section (``from_config``) and called per micro-batch.

    ``eps_clip_high=None`` means ``eps_clip``. The corrections (``megatron_areal.algorithm.offpolicy``;
    the defaults switch them off): ``behav_imp_weight_cap`` drops tokens whose behaviour weight ``w``
    exceeds it (MIS), or with ``behav_imp_weight_mode="truncate"`` keeps every token at weight
    ``min(w, cap)`` (TIS); ``behav_imp_weight_low`` also drops tokens with ``w`` below it (icepop-style
    two-sided mask); ``seq_imp_weight_low`` / ``seq_imp_weight_high`` drop whole sequences whose
    geometric-mean ``w`` over their loss tokens is outside the bounds.
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    behav_imp_weight_cap: float | None = None
    behav_imp_weight_mode: Literal["mask", "truncate"] = "mask"
    behav_imp_weight_low: float | None = None
    seq_imp_weight_low: float | None = None
    seq_imp_weight_high: float | None = None

    @classmethod
    def from_config(cls, cfg: PPOConfig) -> PPOObjective:
        """The objective the ``ppo:`` section describes (its keys carry the same names)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def per_sequence(self) -> bool:
        """Whether a call on a packed 1-D batch needs ``seq_ids`` (a sequence-level mask is on)."""
        return self.seq_imp_weight_low is not None or self.seq_imp_weight_high is not None

    def __call__(self, logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                 advantages: torch.Tensor, loss_mask: torch.Tensor, *, loss_scale_tokens: float | None = None,
                 seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Negated decoupled-PPO objective, summed over tokens, divided by the loss-mask token count.

        All tensors share one shape (packed 1-D or [batch, tokens]). ``loss_mask`` is bool or 0/1.
        Dropped tokens still count in the denominator, so dropping never inflates the other tokens.
        ``loss_scale_tokens`` replaces that denominator when a batch is split into micro-batches or
        across data-parallel ranks: pass the token count of the whole mini-batch so the per-piece
        losses add up to the mini-batch mean. Sequences are the rows of a 2-D batch; a packed 1-D batch
        passes ``seq_ids``, the sequence index of every position (needed only when ``per_sequence``).
        Statistics: those of the stable interface (docs/design.md, "Stable interfaces") and
        ``truncated_tokens``, ``dropped_sequences``, ``ratio_mean``.
        """
        shapes = {t.shape for t in (logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask)}
        if len(shapes) != 1:
            raise ValueError(f"decoupled_ppo_loss: all inputs must share one shape, got {sorted(map(tuple, shapes))}")
        eps_high = self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
        mask = loss_mask.to(torch.bool)
        proximal_logprobs = proximal_logprobs.detach()
        behavior_logprobs = behavior_logprobs.detach()
        advantages = advantages.detach()

        ratio = torch.exp(logprobs - proximal_logprobs)  # u: current vs proximal
        clipped_ratio = ratio.clamp(1.0 - self.eps_clip, 1.0 + eps_high)
        surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
        # w = pi_prox / pi_behav without gradient (inputs detached), corrected per offpolicy.py
        weight, keep, behav_weight, correction = behaviour_correction(
            proximal_logprobs, behavior_logprobs, mask, cap=self.behav_imp_weight_cap,
            mode=self.behav_imp_weight_mode, low=self.behav_imp_weight_low, seq_low=self.seq_imp_weight_low,
            seq_high=self.seq_imp_weight_high, seq_ids=seq_ids)
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
    """The stable interface (docs/design.md, "Stable interfaces"): the decoupled-PPO loss with masked
    importance sampling at ``behav_imp_weight_cap``. The other corrections are ``PPOObjective``'s."""
    objective = PPOObjective(eps_clip=eps_clip, eps_clip_high=eps_clip_high, behav_imp_weight_cap=behav_imp_weight_cap)
    return objective(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
                     loss_scale_tokens=loss_scale_tokens)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate k3 = exp(r) - 1 - r with r = ref - theta.

    Non-negative, unbiased, and low-variance for samples drawn from pi_theta (Schulman, 2020).
    """
    log_ratio = ref_logprobs.detach() - logprobs
    return torch.exp(log_ratio) - 1.0 - log_ratio
