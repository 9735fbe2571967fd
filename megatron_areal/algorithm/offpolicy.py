"""Off-policy corrections of the behaviour weight, and the rollout-vs-trainer mismatch metrics.

This docstring is the one place where the corrections are defined; ``decoupled_ppo_loss`` applies
them and the ``ppo:`` config section switches them on (keys in brackets).

Per loss token ``t`` the decoupled objective (``megatron_areal.algorithm.ppo``) is
``w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps_high) * A_t)`` with the behaviour weight
``w_t = exp(logp_prox_t - logp_behav_t) = pi_prox / pi_behav`` (no gradient). The loss is minus
the sum over the kept tokens divided by ``N``, the number of tokens in the ORIGINAL loss mask:
dropping a token never inflates the others. The corrections change ``w_t`` or the kept set:

- **MIS**, masked importance sampling (``behav_imp_weight_cap: C``, ``behav_imp_weight_mode:
  mask``, the default): drop tokens with ``w_t > C``; kept tokens use ``w_t``.
- **TIS**, truncated importance sampling (``behav_imp_weight_cap: C``, ``behav_imp_weight_mode:
  truncate``): every token is kept with weight ``min(w_t, C)``.
- **Icepop-style two-sided token mask** (``behav_imp_weight_low: L`` with mode ``mask``): drop
  tokens with ``w_t < L`` or ``w_t > C`` (``C`` may be null for a lower bound alone); kept tokens
  use ``w_t``.
- **Sequence-level geometric-mean mask** (``seq_imp_weight_low: L_s``, ``seq_imp_weight_high:
  H_s``, either may be null): for each sequence ``s`` with loss tokens ``T_s``,
  ``g_s = exp(mean_{t in T_s} (logp_prox_t - logp_behav_t))`` (the geometric mean of ``w`` over
  its loss tokens, computed before any token correction); drop every token of ``s`` when
  ``g_s < L_s`` or ``g_s > H_s``. Kept tokens still use their own (possibly truncated) ``w_t``.

The sequence mask composes with either token mode: a token counts when its sequence passes and,
in mask mode, it passes the token bounds. A log-ratio that is not finite (``-inf - -inf``) counts
as 0 (``w = 1``) for the decisions, as in AReaL.

Mismatch metrics (``rollout_mismatch_metrics``): on tokens produced by exactly the weights the
trainer holds (staleness 0) ``pi_prox`` and ``pi_behav`` are the same policy computed by two
engines, so with ``r_t = logp_prox_t - logp_behav_t``:

- ``rollout_mismatch_abs = mean |r_t|``,
- ``rollout_mismatch_kl = mean (exp(r_t) - 1 - r_t)``: the k3 estimator (Schulman, 2020) of
  ``KL(pi_behav || pi_prox)`` from tokens sampled by ``pi_behav``; non-negative, 0 iff equal,

and over ALL loss tokens (any staleness) the quantiles of ``w_t = exp(r_t)``:
``behav_imp_weight_p50/p90/p99/max`` (linear interpolation between order statistics).
Both are 0 (and the quantiles 1) up to float rounding when trainer and rollout compute in fp32.
"""
from __future__ import annotations

from typing import Literal

import torch

BEHAV_IMP_WEIGHT_MODES = ("mask", "truncate")
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def _log_ratio(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
    r = proximal_logprobs.detach().double() - behavior_logprobs.detach().double()
    return torch.where(torch.isfinite(r), r, torch.zeros_like(r))


def sequence_index(shape: torch.Size, seq_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The sequence of every position: the rows of a 2-D input, or ``seq_ids`` (same shape as the
    input, one integer per position) for packed 1-D input."""
    if seq_ids is None:
        if len(shape) != 2:
            raise ValueError("sequence-level correction of a packed 1-D batch needs seq_ids "
                             "(the sequence index of every position)")
        return torch.arange(shape[0], device=device)[:, None].expand(shape)
    if seq_ids.shape != shape:
        raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} != input shape {tuple(shape)}")
    return seq_ids.long()


def sequence_geometric_mean(log_ratio: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-position ``g_s`` of the position's sequence ``ids`` (module docstring); 1 for a
    sequence without loss tokens."""
    _, index = torch.unique(ids.reshape(-1), return_inverse=True)
    n = int(index.max()) + 1 if index.numel() else 0
    m = mask.reshape(-1).to(log_ratio.dtype)
    sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
        0, index, log_ratio.reshape(-1) * m)
    counts = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, index, m)
    return torch.exp(sums / counts.clamp(min=1))[index].reshape(log_ratio.shape)


def behaviour_correction(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float | None = None,
    mode: Literal["mask", "truncate"] = "mask",
    low: float | None = None,
    seq_low: float | None = None,
    seq_high: float | None = None,
    seq_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The corrected behaviour weight and kept-token mask (module docstring).

    Returns ``(weight, keep, raw_w, stats)``: ``weight`` is the per-token factor of the objective
    (``min(w, C)`` under truncate, else ``w``; dtype of ``proximal_logprobs``), ``keep`` the bool
    mask of tokens that enter the sum, ``raw_w`` the uncorrected ``w``, and ``stats`` the counts
    ``dropped_tokens`` (in ``mask``, not kept), ``truncated_tokens`` and ``dropped_sequences``.
    """
    if mode not in BEHAV_IMP_WEIGHT_MODES:
        raise ValueError(f"behav_imp_weight_mode must be one of {BEHAV_IMP_WEIGHT_MODES}, got {mode!r}")
    if mode == "truncate" and cap is None:
        raise ValueError("behav_imp_weight_mode='truncate' needs behav_imp_weight_cap")
    if mode == "truncate" and low is not None:
        raise ValueError("behav_imp_weight_low is a token mask bound; it needs behav_imp_weight_mode='mask'")
    mask = mask.to(torch.bool)
    raw_log_ratio = proximal_logprobs.detach() - behavior_logprobs.detach()
    raw_w = torch.exp(raw_log_ratio)
    w_decide = torch.where(torch.isfinite(raw_log_ratio), raw_w, torch.ones_like(raw_w))
    keep = mask
    stats = {"dropped_tokens": 0.0, "truncated_tokens": 0.0, "dropped_sequences": 0.0}
    if seq_low is not None or seq_high is not None:
        ids = sequence_index(mask.shape, seq_ids, mask.device)
        g = sequence_geometric_mean(_log_ratio(proximal_logprobs, behavior_logprobs), mask, ids)
        seq_ok = torch.ones_like(mask)
        if seq_low is not None:
            seq_ok &= g >= seq_low
        if seq_high is not None:
            seq_ok &= g <= seq_high
        keep = keep & seq_ok
        stats["dropped_sequences"] = float(torch.unique(ids[mask & ~seq_ok]).numel())
    weight = raw_w
    if mode == "mask":
        if cap is not None:
            keep = keep & (w_decide <= cap)
        if low is not None:
            keep = keep & (w_decide >= low)
    else:
        assert cap is not None
        weight = raw_w.clamp(max=cap)
        stats["truncated_tokens"] = float((keep & (w_decide > cap)).sum())
    stats["dropped_tokens"] = float((mask & ~keep).sum())
    return weight, keep, raw_w, stats


def quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile``'s default (linear) quantile, without its input-size limit."""
    v = values.reshape(-1).double().sort().values
    if v.numel() == 0:
        return float("nan")
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def rollout_mismatch_metrics(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                             loss_mask: torch.Tensor, fresh_mask: torch.Tensor) -> dict[str, float]:
    """Mismatch between the trainer's and the rollout's logprobs (module docstring).

    ``fresh_mask`` marks the tokens generated by the weights the trainer held when it computed
    ``trainer_logprobs`` (staleness 0). Returns ``rollout_mismatch_tokens`` (their count), and when
    there are any ``rollout_mismatch_abs`` and ``rollout_mismatch_kl`` (k3); ``behav_imp_weight_p50,
    _p90, _p99, _max`` over all loss tokens when there are any.
    """
    mask = loss_mask.to(torch.bool)
    fresh = fresh_mask.to(torch.bool) & mask
    r = _log_ratio(trainer_logprobs, behavior_logprobs)
    out: dict[str, float] = {"rollout_mismatch_tokens": float(fresh.sum())}
    if bool(fresh.any()):
        rf = r[fresh]
        out["rollout_mismatch_abs"] = float(rf.abs().mean())
        out["rollout_mismatch_kl"] = float((torch.expm1(rf) - rf).mean())
    if bool(mask.any()):
        w = torch.exp(r[mask])
        for name, q in QUANTILES.items():
            out[f"behav_imp_weight_{name}"] = quantile(w, q)
        out["behav_imp_weight_max"] = float(w.max())
    return out
