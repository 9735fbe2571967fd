"""SwiGLU for the local (non-Transformer-Engine) spec, keeping only its input for the backward.

Megatron's unfused gated MLP computes ``silu(a) * (b + glu_linear_offset)`` from the two halves of
``linear_fc1``'s output, and autograd keeps three tensors for the backward: that output (through ``a``),
``silu(a)`` and ``b + 0.0`` (a fresh copy of ``b``): 12 bytes per token and intermediate channel in bf16,
a quarter of all the activations a SmolLM2 micro-batch keeps. Megatron's fused SwiGLU keeps only the
input, but is compiled with ``torch.compile``. ``SwiGLU`` keeps the input and recomputes ``silu(a)`` in
the backward, with the very kernels autograd would run: output and gradients equal the unfused
path's bit for bit. It enters through the layer spec (``MLPSubmodules.activation_func``, which
Megatron's MLP uses when ``use_te_activation_func`` is set).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        a, b = torch.chunk(y, 2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (y,) = ctx.saved_tensors
        a, b = torch.chunk(y, 2, dim=-1)
        # autograd's backward of silu(a) * b: the product's two gradients, then silu's own kernel
        grad_b = grad_out * F.silu(a)
        grad_a = torch.ops.aten.silu_backward(grad_out * b, a)
        return torch.cat((grad_a, grad_b), dim=-1)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for ``a, b = y.chunk(2, -1)``, keeping only ``y`` for the backward."""
    return _SwiGLUFunction.apply(y)


class SwiGLU(torch.nn.Module):
    """The gated MLP's activation as a spec module (built with the layer's config, which it ignores)."""

    def __init__(self, config=None) -> None:
        super().__init__()
        if config is not None and (config.activation_func is not F.silu or not config.gated_linear_unit
                                   or config.glu_linear_offset or config.activation_func_clamp_value is not None):
            raise ValueError("SwiGLU replaces only silu gated linear units without offset or clamp")

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No parameters: nothing in a checkpoint (Megatron's MLP asks each child)."""
        return {}
