"""Accelerator and interconnect facts, each from its vendor's data sheet.

Only published peak figures live here; how much of a peak a kernel reaches is an *efficiency*
and belongs to the cost model's settings (``SimConfig``), where calibration may refit it.
"""
from __future__ import annotations

from dataclasses import dataclass

TB = 1e12
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    name: str
    hbm_bytes: float  # device memory
    hbm_bw: float  # bytes/s, peak HBM bandwidth
    bf16_flops: float  # FLOP/s, dense bf16 tensor-core peak (no sparsity)
    nvlink_bw: float  # bytes/s per GPU, total bidirectional NVLink bandwidth
    net_bw: float  # bytes/s per GPU of inter-node network (one NIC per GPU)
    nvlink_latency_s: float = 5e-6  # one small all-reduce hop inside a node


GPUS: dict[str, GPUSpec] = {
    # H800 SXM5: the export variant of H100 SXM5 used by the paper. Same SM count, HBM3 and
    # tensor cores as H100 (3.35 TB/s, 989 TFLOP/s dense bf16); NVLink cut to 400 GB/s.
    # Nodes of 8 GPUs with 8 x 400 Gb/s NICs (50 GB/s per GPU) as in the paper's cluster.
    "H800": GPUSpec(name="H800", hbm_bytes=80 * GB, hbm_bw=3.35 * TB, bf16_flops=989e12,
                    nvlink_bw=400 * GB, net_bw=50 * GB),
    # H100 SXM5 data sheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink 4 900 GB/s;
    # ConnectX-7 400 Gb/s per GPU in DGX H100.
    "H100": GPUSpec(name="H100", hbm_bytes=80 * GB, hbm_bw=3.35 * TB, bf16_flops=989e12,
                    nvlink_bw=900 * GB, net_bw=50 * GB),
    # H200 SXM data sheet: 141 GB HBM3e, 4.8 TB/s, same Hopper compute as H100, NVLink 900 GB/s.
    "H200": GPUSpec(name="H200", hbm_bytes=141 * GB, hbm_bw=4.8 * TB, bf16_flops=989e12,
                    nvlink_bw=900 * GB, net_bw=50 * GB),
    # A100 SXM 80 GB data sheet: 2.039 TB/s HBM2e, 312 TFLOP/s dense bf16, NVLink 3 600 GB/s;
    # HDR 200 Gb/s per GPU in DGX A100.
    "A100": GPUSpec(name="A100", hbm_bytes=80 * GB, hbm_bw=2.039 * TB, bf16_flops=312e12,
                    nvlink_bw=600 * GB, net_bw=25 * GB),
}


def gpu_spec(name: str) -> GPUSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
