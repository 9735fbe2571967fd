"""Settings of the reward service."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class RewardConfig:
    workers: int = 2  # processes in the reward pool
    timeout_s: float = 10.0  # per answer; a reward that exceeds it scores 0
    code_memory_mb: int = 512
    code_max_processes: int = 32

    def validate(self) -> None:
        require(self.workers >= 1, "workers", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be positive")
