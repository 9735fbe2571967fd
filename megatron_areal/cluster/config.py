"""Settings of the cluster a run is placed on (Slurm or one machine)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class ClusterConfig:
    """The machines a run is placed on: nodes, GPUs, the split between rollout and training, ports, and the
    grace periods of stopping and requeueing."""

    nodes: int = 1  # what --dry-run plans for when not given --nodes; Slurm uses the allocation
    gpus_per_node: int = 0  # 0: CPU nodes (embedded servers, gloo trainer)
    gen_fraction: float = 0.75  # share of nodes that run rollout servers (when gen_nodes is 0)
    gen_nodes: int = 0  # rollout nodes; 0: round(nodes * gen_fraction), at least one of each role
    master_port: int = 29500  # torchrun rendezvous on the first trainer node
    cpu_threads: int = 1  # torch threads per trainer rank on CPU nodes (servers: server.threads)
    cpu_dp: int = 1  # data-parallel size of a CPU trainer node (GPU: trainer GPUs / (tp * pp))
    # malloc of CPU trainer ranks: auto preloads mimalloc where installed (less fragmentation, faster
    # steps than glibc's: launch/allocator.py), mimalloc requires it, glibc leaves malloc alone
    cpu_allocator: Literal["auto", "mimalloc", "glibc"] = "auto"
    server_port_stride: int = 10  # ports reserved per server (SGLang opens a few next to --port)
    gpu_memory_gb: float = 80.0  # per GPU, for the dry-run memory check
    model_params_b: float = 0.0  # billions of parameters; 0: count them from the model's config.json
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL delay when stopping child processes
    # Slurm USR1 (time limit near): how long the trainer may take to reach a step boundary and save a
    # checkpoint before the job requeues anyway; keep it below the lead time of #SBATCH --signal
    requeue_grace_s: float = 480.0
    # A trainer rank touches a heartbeat file every few seconds while its main thread runs; one silent for
    # longer than this has stopped (its main work ended but the process stays, or it is frozen): the
    # launcher ends the run naming it
    progress_timeout_s: float = 120.0

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.nodes >= 1, "nodes", "must be >= 1")
        require(self.gpus_per_node >= 0, "gpus_per_node", "must be >= 0")
        require(0 < self.gen_fraction < 1, "gen_fraction", "must be in (0, 1)")
        require(self.gen_nodes >= 0, "gen_nodes", "must be >= 0")
        require(1024 <= self.master_port <= 65535, "master_port", "must be a port in 1024..65535")
        require(self.cpu_dp >= 1, "cpu_dp", "must be >= 1")
        require(self.cpu_threads >= 1, "cpu_threads", "must be >= 1")
        require(self.server_port_stride >= 1, "server_port_stride", "must be >= 1")
        require(self.gpu_memory_gb > 0, "gpu_memory_gb", "must be positive")
        require(self.model_params_b >= 0, "model_params_b", "must be >= 0")
        require(self.stop_grace_s >= 0, "stop_grace_s", "must be >= 0")
        require(self.requeue_grace_s >= 0, "requeue_grace_s", "must be >= 0")
        require(self.progress_timeout_s >= 15, "progress_timeout_s", "must be >= 15 (heartbeats come every 5 s)")
