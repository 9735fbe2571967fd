"""Settings of the cluster a run is placed on (Slurm or one machine)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class ClusterConfig:
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU machine
    gen_fraction: float = 0.75  # share of GPUs that run rollout servers
    master_port: int = 29500

    def validate(self) -> None:
        require(self.nodes >= 1, "nodes", "must be >= 1")
        require(self.gpus_per_node >= 0, "gpus_per_node", "must be >= 0")
        require(0 < self.gen_fraction < 1, "gen_fraction", "must be in (0, 1)")
