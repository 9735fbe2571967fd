"""Stochastic rounding of fp32 values into bf16: each bf16 value equals its fp32 source in expectation.

The optimizer uses it for the bf16 weights that follow their fp32 masters
(``megatron_areal/patches/bf16_rounding.py``), and the receivers of a LoRA push for the weights they merge
(``base + scale * B @ A``): an update far below bf16's spacing would otherwise round away entirely.
"""
from __future__ import annotations

import torch

_LOW_HALF = 1 << 16
_HIGH_HALF_MASK = -_LOW_HALF  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 mantissa bits
_CHUNK = 1 << 22  # elements rounded at a time


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator,
                      chunk: int = _CHUNK) -> None:
    """Write fp32 ``src`` into bf16 ``dst``, rounding up with probability equal to the dropped fraction.

    Adding a uniform 16-bit integer to the fp32 bit pattern and truncating the low half carries into
    bf16's last mantissa bit exactly when the noise exceeds the complement of the dropped bits; it
    works for both signs since the sign bit is separate (the magnitude rounds away from zero with
    that probability). Done ``chunk`` elements at a time, in the noise tensor itself, so the only
    temporary is one chunk's 16 MiB (the one-piece form held three copies of the largest parameter,
    340 MB for SmolLM2's embedding, at the optimizer step); the draws are the same either way.
    """
    bits = src.detach().contiguous().view(torch.int32).view(-1)
    out = dst.view(-1)
    for start in range(0, bits.numel(), chunk):
        piece = bits[start:start + chunk]
        noise = torch.randint(0, _LOW_HALF, piece.shape, dtype=torch.int32, generator=generator, device=bits.device)
        noise.add_(piece).bitwise_and_(_HIGH_HALF_MASK)
        out[start:start + chunk].copy_(noise.view(torch.float32))  # exact: the low half is zero
