"""The server's finiteness check on installed weights (``server.weights.check_finite``), held to torch's
elementwise ``isfinite`` and the model dtype's range: the sum it reads first must neither let a bad
tensor through nor refuse a good one whose sum overflows."""
from __future__ import annotations

import pytest
import torch

from megatron_areal.server.weights import WeightError, check_finite


def reference_bad(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> list[str]:
    """The tensors an elementwise check refuses: a NaN or infinity, or a value beyond the model dtype's largest."""
    bad = []
    for name, t in tensors.items():
        limit = torch.finfo(dtypes.get(name, t.dtype)).max
        if not bool(torch.isfinite(t).all()) or bool((t.double().abs() > limit).any()):
            bad.append(name)
    return bad


def verdict(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> list[str]:
    try:
        check_finite(tensors, dtypes)
    except WeightError as e:
        return [name for name in tensors if name in str(e)]
    return []


def cases() -> list[tuple[str, dict[str, torch.Tensor], dict[str, torch.dtype]]]:
    g = torch.Generator().manual_seed(0)
    fine = torch.randn(64, 32, generator=g)
    huge = torch.full((8, 8), 3.0e38)  # every value finite, the sum overflows float32
    mixed_inf = torch.tensor([float("inf"), -float("inf"), 1.0])  # the sum is NaN
    nan_one = fine.clone()
    nan_one[5, 7] = float("nan")
    inf_one = fine.clone()
    inf_one[0, 0] = float("inf")
    beyond_half = fine.clone()
    beyond_half[1, 1] = 70000.0  # finite in float32, beyond float16's 65504
    fp32 = torch.float32
    return [
        ("finite", {"w.a": fine, "w.b": fine.to(torch.bfloat16)}, {"w.a": fp32, "w.b": torch.bfloat16}),
        ("sum overflows", {"w.huge": huge, "w.a": fine}, {"w.huge": fp32, "w.a": fp32}),
        ("nan", {"w.a": fine, "w.nan": nan_one}, {"w.a": fp32, "w.nan": fp32}),
        ("inf", {"w.inf": inf_one}, {"w.inf": fp32}),
        ("inf and -inf", {"w.both": mixed_inf}, {"w.both": fp32}),
        ("bf16 nan", {"w.bf": nan_one.to(torch.bfloat16)}, {"w.bf": torch.bfloat16}),
        ("beyond the model dtype", {"w.half": beyond_half, "w.ok": fine},
         {"w.half": torch.float16, "w.ok": torch.float16}),
        ("bf16 into fp32", {"w.up": fine.to(torch.bfloat16)}, {"w.up": fp32}),
        ("huge into bf16", {"w.huge": huge}, {"w.huge": torch.bfloat16}),
    ]


@pytest.mark.parametrize("label,tensors,dtypes", cases(), ids=[c[0] for c in cases()])
def test_check_finite_agrees_with_an_elementwise_check(label: str, tensors: dict[str, torch.Tensor],
                                                       dtypes: dict[str, torch.dtype]) -> None:
    assert verdict(tensors, dtypes) == reference_bad(tensors, dtypes), label
