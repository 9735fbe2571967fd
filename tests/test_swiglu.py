"""The local spec's SwiGLU (actor/swiglu.py) against autograd through Megatron's unfused formula."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_areal.actor.swiglu import SwiGLU, swiglu


def _saved_bytes(fn, y: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(y)
    return sum(seen.values())


def _unfused(y: torch.Tensor) -> torch.Tensor:  # megatron/core/transformer/mlp.py's glu, offset 0
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * (b + 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_and_gradient_equal_the_unfused_path_bit_for_bit(dtype):
    torch.manual_seed(0)
    y = (torch.randn(96, 1, 2 * 160) * 3).to(dtype)
    grad = torch.randn(96, 1, 160).to(dtype)
    ours, ref = y.clone().requires_grad_(), y.clone().requires_grad_()
    out, out_ref = swiglu(ours), _unfused(ref)
    out.backward(grad)
    out_ref.backward(grad)
    assert torch.equal(out, out_ref)
    assert torch.equal(ours.grad, ref.grad)


def test_keeps_only_its_input():
    y = torch.randn(256, 1, 2 * 384, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_bytes(swiglu, y) == y.numel() * 2
    assert _saved_bytes(_unfused, y) == y.numel() * 2 * 2  # the input, silu(a) and a copy of b


def test_refuses_other_activations():
    from types import SimpleNamespace

    cfg = SimpleNamespace(activation_func=F.gelu, gated_linear_unit=True, glu_linear_offset=0.0,
                          activation_func_clamp_value=None)
    with pytest.raises(ValueError, match="silu"):
        SwiGLU(cfg)
