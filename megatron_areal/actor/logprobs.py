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


_CHUNK_ELEMENTS = 1 << 22  # logits worked on at a time: 16 MiB in fp32


class _VocabParallelLogprobs(torch.autograd.Function):
    """logits_local [T, V/tp] (any dtype), targets [T] -> (logprobs [T], entropy [T], no grad).

    Memory: the fp32 work (the cast, the temperature, the shift by the row maximum, the
    exponentials) is done a block of rows at a time, and the backward recomputes it from the logits
    themselves, which are kept anyway; so besides its input and its ``[T, V/tp]`` gradient (in the
    logits' dtype) this never holds more than a block of about 16 MiB. The one-piece form held three
    fp32 ``[T, V/tp]`` tensors at its peak (about 200 MB each for 1024 tokens of a 49k vocabulary)
    and kept one for the backward. The values are the same, operation by operation, as computing
    on the whole tensor: each row's results depend on that row only.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                vocab_start: int, vocab_real: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = logits.shape
        real = max(0, min(width, vocab_real - vocab_start))  # local columns inside the real vocabulary
        step = max(1, _CHUNK_ELEMENTS // max(width, 1))
        blocks = [slice(a, min(a + step, rows)) for a in range(0, rows, step)]
        zmax = torch.full((rows,), _MASKED, dtype=torch.float32, device=logits.device)
        for b in blocks:
            zmax[b] = _scaled(logits, b, temperature, real).max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, group)
        local = (targets >= vocab_start) & (targets < vocab_start + width)
        index = (targets - vocab_start).clamp(0, width - 1)
        sums = torch.zeros(3, rows, dtype=torch.float32, device=logits.device)  # sum exp, target z, sum exp * z
        for b in blocks:
            z = _scaled(logits, b, temperature, real).sub_(zmax[b].unsqueeze(-1))
            sums[1, b] = torch.where(local[b], z.gather(-1, index[b].unsqueeze(-1)).squeeze(-1), sums[1, b])
            exp = z.exp()
            sums[2, b] = torch.bmm(exp.unsqueeze(1), z.unsqueeze(2)).view(-1)
            sums[0, b] = exp.sum(-1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z, sum_pz = sums
        log_sum = sum_exp.log()
        logprobs = target_z - log_sum
        entropy = log_sum - sum_pz / sum_exp
        ctx.mark_non_differentiable(entropy)
        if ctx.needs_input_grad[0]:
            ctx.blocks, ctx.temperature, ctx.real = blocks, temperature, real
            ctx.save_for_backward(logits, zmax, sum_exp, index, local)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None):
        logits, zmax, sum_exp, index, local = ctx.saved_tensors
        grad = torch.empty_like(logits)
        # d log p_target / d z_j = [j == target] - p_j (the max shift has zero net gradient);
        # z = logits / T, so the logits' gradient is that over T
        for b in ctx.blocks:
            g = _scaled(logits, b, ctx.temperature, ctx.real).sub_(zmax[b].unsqueeze(-1)).exp_()
            g.div_(sum_exp[b].unsqueeze(-1)).neg_()
            g.scatter_add_(-1, index[b].unsqueeze(-1), local[b].to(g.dtype).unsqueeze(-1))
            g.mul_(grad_logprobs[b].unsqueeze(-1))
            grad[b] = g if ctx.temperature == 1.0 else g.div_(ctx.temperature)
        return grad, None, None, None, None, None


def _scaled(logits: torch.Tensor, block: slice, temperature: float, real: int) -> torch.Tensor:
    """A new fp32 tensor: the block's logits over the temperature, columns past the real vocabulary
    masked (never a view of the caller's logits, which the callers then work on in place)."""
    z = logits[block].to(torch.float32, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    if real < z.size(-1):
        z[:, real:] = _MASKED
    return z


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
    temp = effective_temperature(temperature)
    logprobs, entropy = _VocabParallelLogprobs.apply(logits.reshape(-1, width), targets.reshape(-1), tp_group,
                                                     tp_rank * width, vocab_size, temp)
    return logprobs.view(shape), entropy.view(shape)
