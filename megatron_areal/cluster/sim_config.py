"""Settings that only the cluster simulator reads: hardware and workload facts a real run's
config does not carry, plus the efficiency figures that calibration may refit.

Everything about the run itself (batch, group size, eta, TP/PP, server count, GPUs, split) is read
from the same config tree the trainer uses, so a user simulates the run they are about to launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_areal.cluster.hardware import GPUS
from megatron_areal.configbase import require


@dataclass(kw_only=True)
class SimConfig:
    """What the cluster simulator needs beyond the run's own config: the GPU, the workload's lengths, the
    synchronous baseline's placement, and efficiencies that calibration refits."""

    gpu: str = "H800"  # a name in megatron_areal.cluster.hardware.GPUS
    seed: int = 0
    steps: int = 24  # training steps simulated per run
    warmup_steps: int = 6  # first steps left out of the steady-state averages (pipeline fill)
    # --- workload (not in the real config: what the policy will generate)
    prompt_mean_tokens: float = 400.0  # competition-math prompts with a chat template
    response_mean_tokens: float = 8000.0  # mean response length before truncation
    response_sigma: float = 1.0  # log-space standard deviation of the log-normal length law
    # --- sync baseline placement: "split" runs the same split as the async run, idle in turns
    # (what `staleness.overlap=false` does in a real run); "colocated" time-shares every GPU.
    sync_placement: Literal["split", "colocated"] = "split"
    sync_gen_fraction: float = 0.0  # 0: same as cluster.gen_fraction
    interruptible: bool = True  # False: an update waits until a server's in-flight requests finish
    max_running: int = 0  # cap on sequences decoded together per server; 0: KV-cache bound only
    # --- efficiencies: fractions of a published peak a kernel reaches (calibration refits them)
    hbm_efficiency: float = 0.8  # memory-bound decode GEMV/attention kernels
    decode_flops_efficiency: float = 0.6  # compute-bound large-batch decode
    prefill_mfu: float = 0.5  # prefill (KV rebuild) forward passes
    train_mfu: float = 0.4  # Megatron training incl. TP communication
    net_efficiency: float = 0.8  # NCCL bus bandwidth over the NIC line rate
    # --- fixed costs per event (calibration refits decode_step_overhead_s)
    decode_step_overhead_s: float = 5e-4  # host side of one decode step: scheduling, sampling
    kernel_gap_s: float = 4e-6  # idle gap between two kernels of a CUDA graph replay
    kernels_per_layer: int = 10  # norm, qkv, rope, attention, o, norm, gate/up, act, down, add
    update_overhead_s: float = 0.5  # pause/resume RPCs and the version bookkeeping of one update
    optimizer_bytes_per_param: float = 16.0  # Adam: fp32 master, two moments, grads, read+write
    # --- the weight push (sim/push.py): link bandwidths in GB/s per direction, before net_efficiency
    push_nvlink_gbs: float = 450.0  # NVLink 4 (H100/H200): 900 GB/s both ways per GPU
    push_ib_gbs: float = 50.0  # one 400 Gb/s NDR InfiniBand NIC per GPU
    push_gloo_gbs: float = 1.0  # gloo over TCP between CPU processes (a CPU run)
    push_convert_gbs: float = 274.0  # gather + HF conversion + packing on a sender: 255 GiB/s measured on an H200

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.gpu in GPUS, "gpu", f"unknown GPU {self.gpu!r}; known: {', '.join(GPUS)}")
        require(self.steps > self.warmup_steps >= 0, "steps", "must exceed warmup_steps (>= 0)")
        require(self.prompt_mean_tokens >= 1, "prompt_mean_tokens", "must be >= 1")
        require(self.response_mean_tokens >= 1, "response_mean_tokens", "must be >= 1")
        require(0 < self.response_sigma <= 3, "response_sigma", "must be in (0, 3]")
        require(self.sync_gen_fraction == 0 or 0 < self.sync_gen_fraction < 1, "sync_gen_fraction",
                "must be 0 (same as cluster.gen_fraction) or in (0, 1)")
        require(self.max_running >= 0, "max_running", "must be >= 0")
        for key in ("hbm_efficiency", "decode_flops_efficiency", "prefill_mfu", "train_mfu",
                    "net_efficiency"):
            require(0 < getattr(self, key) <= 1, key, "must be in (0, 1]")
        for key in ("push_nvlink_gbs", "push_ib_gbs", "push_gloo_gbs", "push_convert_gbs"):
            require(getattr(self, key) > 0, key, "must be > 0")
        for key in ("decode_step_overhead_s", "kernel_gap_s", "update_overhead_s"):
            require(getattr(self, key) >= 0, key, "must be >= 0")
