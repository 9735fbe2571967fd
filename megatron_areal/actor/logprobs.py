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
    """logits_local [T, V/tp] (fp32), targets [T] -> (logprobs [T], entropy [T], no grad).

    Memory: besides the input, the forward holds two ``[T, V/tp]`` fp32 tensors at its peak (the
    shifted logits and their exponentials) and keeps one for backward (the softmax, reused in place
    as the gradient), instead of the six or so an expression-per-line version allocates (about
    200 MB each for 1024 tokens of a 49k vocabulary). The entropy's ``sum_j p_j z_j`` is a
    batched dot product, never a ``[T, V]`` product.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                vocab_start: int, vocab_real: int, owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        width = logits.size(-1)
        real = max(0, min(width, vocab_real - vocab_start))  # local columns inside the real vocabulary
        z = logits if owned else None
        if real < width:
            z = logits.clone() if z is None else z
            z[:, real:] = _MASKED
        src = logits if z is None else z
        zmax = src.max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        z = torch.sub(src, zmax.unsqueeze(-1)) if z is None else z.sub_(zmax.unsqueeze(-1))
        local = (targets >= vocab_start) & (targets < vocab_start + width)
        index = (targets - vocab_start).clamp(0, width - 1)
        target_z = torch.where(local, z.gather(-1, index.unsqueeze(-1)).squeeze(-1), torch.zeros_like(zmax))
        exp = z.exp()
        sum_pz = torch.bmm(exp.unsqueeze(1), z.unsqueeze(2)).view(-1)
        del z
        sums = torch.stack([exp.sum(-1), target_z, sum_pz])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z, sum_pz = sums
        log_sum = sum_exp.log()
        logprobs = target_z - log_sum
        entropy = log_sum - sum_pz / sum_exp
        ctx.mark_non_differentiable(entropy)
        if ctx.needs_input_grad[0]:
            softmax = exp.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(softmax, index, local)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None):
        softmax, index, local = ctx.saved_tensors
        # d log p_target / d z_j = [j == target] - p_j; the max shift has zero net gradient.
        # The saved softmax is used once (no double backward), so it becomes the gradient in place.
        grad = softmax.neg_()
        grad.scatter_add_(-1, index.unsqueeze(-1), local.to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_logprobs.unsqueeze(-1)), None, None, None, None, None


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
    flat = logits.reshape(-1, width)
    temp = effective_temperature(temperature)
    scaled = flat.float() if temp == 1.0 else flat.float() / temp
    # the kernel may work in place on a tensor made here (a cast or a division), not on the caller's
    owned = scaled.data_ptr() != flat.data_ptr()
    logprobs, entropy = _VocabParallelLogprobs.apply(scaled, targets.reshape(-1), tp_group, tp_rank * width,
                                                     vocab_size, owned)
    return logprobs.view(shape), entropy.view(shape)
