"""The dtype a device can compute in: one rule for the trainer, the embedded server and vLLM on CPUs.

On a CPU without native bf16 matrix multiplies (AVX512-BF16 or AMX-BF16; AVX2-only CPUs such as
many EPYCs) torch runs bf16 matmuls through slow reference kernels, so a requested bf16 runs in
fp32 there, with a warning. Both sides of a run fall back together, so the policy the server samples
from and the one the trainer scores are computed in the same dtype.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
# "1": keep bf16 on any CPU (many times slower without native bf16; tests of the bf16 paths set it);
# "0": compute as on a CPU without native bf16 (with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and
# MKL_ENABLE_INSTRUCTIONS=AVX2, an AVX512 machine runs the main job as an AVX2-only CPU would)
BF16_ANYWAY_ENV = "MEGATRON_AREAL_CPU_BF16"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16).

    Measured on a 2-core AVX2 EPYC: a SmolLM2 output-layer backward matmul ([1024, 49152] x
    [49152, 576]) took 111 s in bf16 against 0.6 s in fp32, the forward 3.5 s against 1.1 s; a
    [64, 576] x [576, 1536] linear 13.2 ms against 2.0 ms on one thread.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def runnable_dtype(dtype: torch.dtype, device: torch.device, who: str) -> torch.dtype:
    """``dtype``, or fp32 where it is bf16 on a CPU without native bf16 matmuls (``who`` names the
    setting in the warning) unless ``MEGATRON_AREAL_CPU_BF16=1`` (``=0``: as if the CPU had none)."""
    forced = os.environ.get(BF16_ANYWAY_ENV)
    native = cpu_has_native_bf16() if forced != "0" else False
    if dtype == torch.bfloat16 and device.type == "cpu" and not native and forced != "1":
        log.warning("%s=bfloat16: this CPU has no native bf16 matmul (AVX512-BF16/AMX), where bf16 runs "
                    "many times slower than fp32; computing in float32 instead", who)
        return torch.float32
    return dtype


def cpu_dtype_name(name: str, who: str) -> str:
    """``runnable_dtype`` on this CPU for a dtype named as configs and server flags name it (``bfloat16``):
    the launcher passes it to servers that do not fall back themselves (vLLM's CPU build)."""
    return str(runnable_dtype(getattr(torch, name), torch.device("cpu"), who)).removeprefix("torch.")
