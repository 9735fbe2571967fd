"""bf16 on a CPU without native bf16 matmuls: the trainer and the embedded server fall back to fp32
together (a bf16 server on an AVX2-only CPU generated too slowly for the main job to finish a step in
9 minutes), and keep bf16 where the CPU multiplies it in hardware."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_areal.actor.model import resolve_dtype
from megatron_areal.server.config import EngineOptions
from megatron_areal.server.engine import Engine
from megatron_areal.util import compute_dtype


@pytest.mark.parametrize("native", [False, True])
def test_trainer_and_server_compute_in_the_same_dtype(tiny_llama, monkeypatch, caplog, native: bool) -> None:
    monkeypatch.setattr(compute_dtype, "cpu_has_native_bf16", lambda: native)
    expected = torch.bfloat16 if native else torch.float32
    with caplog.at_level(logging.WARNING, logger=compute_dtype.__name__):
        trainer = resolve_dtype("bfloat16", torch.device("cpu"))
        engine = Engine(tiny_llama, EngineOptions(max_running=2, context_length=64, dtype="bfloat16"))
    assert trainer == engine.dtype == expected
    assert {p.dtype for p in engine.model.parameters()} == {expected}
    assert engine.cache.k.dtype == engine.cache.v.dtype == expected
    warned = [r.getMessage() for r in caplog.records if "no native bf16 matmul" in r.getMessage()]
    assert len(warned) == (0 if native else 2), warned


def test_cpu_flags_are_read_from_proc() -> None:
    flags = open("/proc/cpuinfo").read()
    assert compute_dtype.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_explicit_float32_and_auto_are_kept(monkeypatch) -> None:
    monkeypatch.setattr(compute_dtype, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype.runnable_dtype(torch.bfloat16, torch.device("cuda"), "x") == torch.bfloat16


def test_bf16_can_be_kept_on_purpose(monkeypatch) -> None:
    monkeypatch.setattr(compute_dtype, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv(compute_dtype.BF16_ANYWAY_ENV, "1")
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_a_bf16_cpu_can_run_as_one_without(monkeypatch) -> None:
    """``MEGATRON_AREAL_CPU_BF16=0``: how an AVX512-BF16 machine measures what an AVX2 user sees."""
    monkeypatch.setattr(compute_dtype, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv(compute_dtype.BF16_ANYWAY_ENV, "0")
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.float32
