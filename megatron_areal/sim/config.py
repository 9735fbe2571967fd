"""Settings that only the cluster simulator reads (hardware and workload facts)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SimConfig:
    gpu: str = "H800"
    seed: int = 0
