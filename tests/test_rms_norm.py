"""The trainer's local-spec RMSNorm against ``torch.rms_norm`` (forward bitwise, backward by autograd)."""
from __future__ import annotations

import pytest
import torch

from megatron_areal.patches.rms_norm import RMSNorm, rms_norm


def _inputs(dtype: torch.dtype, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 96, generator=gen) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(weight_dtype).requires_grad_()
    grad = torch.randn(3, 40, 96, generator=gen).to(dtype)
    return x, weight, grad


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float32)])
def test_equals_torch_rms_norm(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    x, weight, grad = _inputs(dtype, weight_dtype)
    ref = torch.rms_norm(x, (96,), weight, 1e-6)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x, weight), grad)
    dx, dw = torch.autograd.grad(out, (x, weight), grad)
    assert dx.dtype == x.dtype and dw.dtype == weight.dtype
    # torch differentiates its composite graph op by op, rounding between ops in bf16 only at the end
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(dw.float(), ref_dw.float(), rtol=tol, atol=tol * 10)


def test_gradients_in_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(16, dtype=torch.float64, generator=gen)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6), (x, weight))


def _saved_bytes(fn) -> int:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_keeps_only_the_input_and_a_scale_per_row() -> None:
    x = torch.randn(512, 96, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(96, eps=1e-6, dtype=torch.bfloat16)
    ours = _saved_bytes(lambda: norm(x))
    assert ours == x.numel() * 2 + 96 * 2 + 512 * 4  # input, weight, fp32 scale per row
    theirs = _saved_bytes(lambda: torch.rms_norm(x, (96,), norm.weight, 1e-6))
    assert theirs > 5 * ours, (ours, theirs)
