"""Rotary position embedding frequencies, the one computation the trainer and the servers share.

The Megatron actor and the embedded server both call ``rope_inv_freq``, so a model trains and
generates with the same positions. The numbers are Hugging Face's (``modeling_rope_utils``):
default, linear and llama3 scaling; llama3 needs all four of its keys, as transformers does.
"""
from __future__ import annotations

import math

import torch

from megatron_areal.model.arch import ModelArch, UnsupportedModelError

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise UnsupportedModelError(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
    factor, low, high, old_len = (float(scaling[k]) for k in LLAMA3_KEYS)
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse RoPE frequencies of ``arch`` (fp32, ``head_dim / 2`` of them)."""
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
