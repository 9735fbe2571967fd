"""Per-token logprobs and entropy from vocabulary-parallel logits, never gathering the vocabulary.

Each TP rank holds logits for its slice ``[start, start + V/tp)`` of the padded vocabulary. The
log-softmax needs only three all-reduces over the TP group of ``[T]``-sized tensors: the max, the
sum of exponentials, and the target's logit (present on exactly one rank). Entropy needs one more
(the sum of ``p * z``). Columns past the real vocabulary (TP padding) are excluded, so the
distribution is the one the inference servers sample from.

Temperature: logprobs are ``log_softmax(logits / T)``, which is what a server sampling at
temperature ``T`` reports; ``T = 0`` (greedy) is treated as ``T = 1``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_MASKED = -1e30  # finite (unlike -inf) so p * z stays 0 for masked columns in the entropy


def effective_temperature(temperature: float) -> float:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


class _VocabParallelLogprobs(torch.autograd.Function):
    """logits_local [T, V/tp] (fp32), targets [T] -> (logprobs [T], entropy [T], no grad)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                vocab_start: int, vocab_real: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = logits.size(-1)
        columns = torch.arange(vocab_start, vocab_start + width, device=logits.device)
        z = logits.masked_fill(columns >= vocab_real, _MASKED)
        zmax = z.max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        z = z - zmax.unsqueeze(-1)
        local = (targets >= vocab_start) & (targets < vocab_start + width)
        index = (targets - vocab_start).clamp(0, width - 1)
        target_z = torch.where(local, z.gather(-1, index.unsqueeze(-1)).squeeze(-1), torch.zeros_like(zmax))
        exp = z.exp()
        sums = torch.stack([exp.sum(-1), target_z, (exp * z).sum(-1)])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z, sum_pz = sums
        logprobs = target_z - sum_exp.log()
        entropy = sum_exp.log() - sum_pz / sum_exp
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, local)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None):
        softmax, index, local = ctx.saved_tensors
        # d log p_target / d z_j = [j == target] - p_j; the max shift has zero net gradient
        grad = -softmax
        grad.scatter_add_(-1, index.unsqueeze(-1), local.to(grad.dtype).unsqueeze(-1))
        return grad * grad_logprobs.unsqueeze(-1), None, None, None, None


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, tp_group: dist.ProcessGroup | None,
                            tp_rank: int, vocab_size: int, temperature: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` and the entropy, per position, from this rank's logit slice.

    ``logits`` is ``[..., V/tp]`` (any dtype; computed in fp32), ``targets`` ``[...]``;
    ``vocab_size`` is the real (unpadded) vocabulary. Differentiable w.r.t. ``logits``
    (logprobs only). Identical results on every TP rank.
    """
    width = logits.size(-1)
    shape = targets.shape
    scaled = logits.reshape(-1, width).float() / effective_temperature(temperature)
    logprobs, entropy = _VocabParallelLogprobs.apply(scaled, targets.reshape(-1), tp_group, tp_rank * width,
                                                     vocab_size)
    return logprobs.view(shape), entropy.view(shape)
