"""One simulated setting, resolved from the run's config tree: who generates, who trains, with
which model, batch and staleness bound. ``from_config`` is the only place that reads ``Config``."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_areal.cluster.hardware import GB, GPUSpec, gpu_spec
from megatron_areal.cluster.sim_config import SimConfig
from megatron_areal.config import Config
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.catalogue import resolve_arch


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class Scenario:
    model: ModelArch
    model_name: str
    gpu: GPUSpec
    sim: SimConfig
    batch_size: int  # groups per training step
    group_size: int
    max_new_tokens: int
    eta: int
    max_concurrent: int  # groups in flight
    n_servers: int
    server_tp: int
    train_gpus: int
    train_tp: int
    train_pp: int
    n_minibatches: int
    max_tokens_per_mb: int
    mem_fraction: float
    colocated: bool = False  # generation and training time-share the same GPUs
    interruptible: bool = True
    train_ep: int = 1  # expert parallel (MoE): ranks the experts are split over
    train_etp: int = 1  # expert tensor parallel (MoE)
    gpus_per_node: int = 8  # decides which all-to-all peers are on NVLink
    discard_fraction: float = 0.0  # finished groups thrown away untrained (all-equal rewards filtered)
    engine: str = "sglang"  # the rollout servers' kind: SGLang takes the stage heads' push, others shard to shard
    push_bucket_bytes: int = 512 << 20  # weights.bucket_mb

    @property
    def gen_gpus(self) -> int:
        return self.n_servers * self.server_tp

    @property
    def total_gpus(self) -> int:
        return self.gen_gpus if self.colocated else self.gen_gpus + self.train_gpus

    @property
    def label(self) -> str:
        mode = "sync" if self.eta == 0 else f"async eta={self.eta}"
        place = "colocated" if self.colocated else f"{self.gen_gpus} gen + {self.train_gpus} train"
        return f"{self.model_name} {mode}, {place} GPUs"

    def replace(self, **changes) -> Scenario:
        return dataclasses.replace(self, **changes)


def split_gpus(total: int, gen_fraction: float, server_tp: int, train_unit: int) -> tuple[int, int]:
    """Servers and training GPUs for a split of ``total`` GPUs; both sides get at least one unit."""
    if total < server_tp + train_unit:
        raise ScenarioError(f"{total} GPUs cannot hold one server (tp={server_tp}) and one trainer "
                            f"replica ({train_unit} GPUs: tp*pp, times ep for MoE)")
    gen = round(total * gen_fraction / server_tp) * server_tp
    gen = min(max(gen, server_tp), total - train_unit)
    train = (total - gen) // train_unit * train_unit
    return gen // server_tp, train


# One single-threaded process of a CPU run (cluster.gpus_per_node = 0) as the simulator's device. Nominal
# figures of one modern x86 core: the DDR5 bandwidth one core draws, and a matmul peak of 1 TFLOP/s (one
# core's AMX bf16 matmul measured 1.1 TFLOP/s on a Xeon; fp32 on AVX2 or AVX-512 does 0.1-0.2, so a calibrated
# fp32 run fits an MFU near a tenth of an AMX run's). Calibration against the run (``--calibrate``) refits the
# overheads and MFU that carry the real speed, so these only shape the model; the peak must not be below what
# a core does (the fitted MFU is bounded by 1). Processes talk over loopback (weight pushes over gloo/TCP).
CPU_PROCESS = GPUSpec(name="CPU process", hbm_bytes=16 * GB, hbm_bw=10 * GB, bf16_flops=1e12,
                      nvlink_bw=5 * GB, net_bw=5 * GB)


def from_config(cfg: Config, *, mode: str = "config", gen_fraction: float | None = None,
                total_gpus: int | None = None) -> Scenario:
    """``mode``: "config" (what the config says), "async" or "sync" (the baseline the sim section
    describes). ``total_gpus`` / ``gen_fraction`` override the cluster for sweeps. A CPU run
    (``cluster.gpus_per_node`` 0) is simulated as it runs: one device per server and trainer process."""
    if cfg.cluster.gpus_per_node == 0 and total_gpus is None:
        return _cpu_run(cfg, mode)
    sim = cfg.sim
    gpus = total_gpus or cfg.cluster.nodes * cfg.cluster.gpus_per_node
    if gpus <= 0:
        raise ScenarioError("cluster.gpus_per_node is 0 (a CPU machine): set cluster.nodes and "
                            "cluster.gpus_per_node to the GPU cluster you want to simulate")
    sync = mode == "sync" or (mode == "config" and not cfg.staleness.overlap)
    # An explicit async request on a synchronous config uses the paper's eta = 4.
    eta = 0 if sync else (cfg.staleness.eta or (4 if mode == "async" else 0))
    par = cfg.parallel
    # EP ranks come out of data parallel (DP a multiple of EP) and ETP x EP x PP divides the trainer.
    unit = math.lcm(par.tp * par.pp * par.ep, par.etp * par.ep * par.pp)
    colocated = sync and sim.sync_placement == "colocated"
    if colocated:
        n_servers, train = gpus // cfg.server.tp, gpus
    else:
        frac = gen_fraction or (sim.sync_gen_fraction if sync and sim.sync_gen_fraction
                                else cfg.cluster.gen_fraction)
        n_servers, train = split_gpus(gpus, frac, cfg.server.tp, unit)
    if train < unit:
        raise ScenarioError(f"{train} training GPUs cannot hold parallel.tp*pp*ep={unit}")
    name, arch = _arch(cfg.model.path)
    if arch.is_moe and arch.num_experts % par.ep:
        raise ScenarioError(f"parallel.ep ({par.ep}) does not divide the model's {arch.num_experts} experts")
    if not arch.is_moe and (par.ep > 1 or par.etp > 1):
        raise ScenarioError(f"parallel.ep / parallel.etp apply to Mixture-of-Experts models; {name} is dense")
    return Scenario(model=arch, model_name=name, gpu=gpu_spec(sim.gpu), sim=sim,
                    batch_size=cfg.rollout.batch_size, group_size=cfg.rollout.group_size,
                    max_new_tokens=cfg.rollout.max_new_tokens, eta=eta,
                    max_concurrent=cfg.rollout.max_concurrent, n_servers=n_servers, server_tp=cfg.server.tp,
                    train_gpus=train, train_tp=cfg.parallel.tp, train_pp=cfg.parallel.pp,
                    n_minibatches=cfg.ppo.n_minibatches, max_tokens_per_mb=cfg.parallel.max_tokens_per_mb,
                    mem_fraction=cfg.server.mem_fraction, colocated=colocated,
                    interruptible=sim.interruptible, train_ep=par.ep, train_etp=par.etp,
                    gpus_per_node=cfg.cluster.gpus_per_node, engine=cfg.server.engine,
                    push_bucket_bytes=cfg.weights.bucket_bytes)


def _arch(path: str) -> tuple[str, ModelArch]:
    """A catalogue model, an HF folder, or a model the package ships (``assets``: SmolLM2 for the CPU run)."""
    try:
        return resolve_arch(path)
    except ValueError:
        from megatron_areal.model.assets import BUILTIN_MODELS, resolve_model

        if path not in BUILTIN_MODELS:
            raise
        return path, resolve_arch(str(resolve_model(path)))[1]


def _cpu_run(cfg: Config, mode: str) -> Scenario:
    """The run on one CPU machine: ``server.count`` servers and ``cluster.cpu_dp`` x tp x pp trainer
    processes, each a ``CPU_PROCESS``; the server's ``max_running`` caps its batch."""
    sync = mode == "sync" or (mode == "config" and not cfg.staleness.overlap)
    eta = 0 if sync else (cfg.staleness.eta or (4 if mode == "async" else 0))
    par = cfg.parallel
    name, arch = _arch(cfg.model.path)
    sim = cfg.sim if cfg.sim.max_running else dataclasses.replace(cfg.sim, max_running=cfg.server.max_running)
    return Scenario(model=arch, model_name=name, gpu=CPU_PROCESS, sim=sim,
                    batch_size=cfg.rollout.batch_size, group_size=cfg.rollout.group_size,
                    max_new_tokens=cfg.rollout.max_new_tokens, eta=eta, max_concurrent=cfg.rollout.max_concurrent,
                    n_servers=cfg.server.count, server_tp=cfg.server.tp,
                    train_gpus=cfg.cluster.cpu_dp * par.tp * par.pp, train_tp=par.tp, train_pp=par.pp,
                    n_minibatches=cfg.ppo.n_minibatches, max_tokens_per_mb=cfg.parallel.max_tokens_per_mb,
                    mem_fraction=cfg.server.mem_fraction, interruptible=cfg.sim.interruptible,
                    gpus_per_node=cfg.server.count + cfg.cluster.cpu_dp)
