"""Settings of the reward service."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class RewardConfig:
    """The reward process pool (workers, per-answer timeout) and the limits of the code sandbox."""

    workers: int = 2  # processes in the reward pool
    timeout_s: float = 10.0  # per answer; a reward that exceeds it scores 0 and its worker is replaced
    worker_start_timeout_s: float = 120.0  # a worker that cannot import its verifiers in this time is an error
    math_deadline_s: float = 3.0  # CPU seconds per math answer; past them it scores 0 and the worker is kept
    # Sandboxed code execution (task "code"); every limit applies to each run of an answer.
    code_wall_s: float = 6.0  # wall clock; the whole process tree is killed after it
    code_cpu_s: int = 4  # CPU seconds per process
    code_memory_mb: int = 512  # memory of the whole sandbox (a cgroup where possible), and address space per process
    code_max_processes: int = 32  # processes the sandbox user may add
    code_file_mb: int = 16  # largest file an answer may write (its scratch is a tmpfs of 4x this)
    code_python: str = ""  # interpreter inside the sandbox; "" picks one the sandbox user can execute

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.workers >= 1, "workers", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be positive")
        require(self.worker_start_timeout_s > 0, "worker_start_timeout_s", "must be positive")
        require(self.math_deadline_s > 0, "math_deadline_s", "must be positive")
        require(self.code_wall_s > 0, "code_wall_s", "must be positive")
        require(self.code_wall_s < self.timeout_s, "code_wall_s",
                f"must be below timeout_s ({self.timeout_s}) so the sandbox, not the pool, stops slow code")
        require(self.code_cpu_s >= 1, "code_cpu_s", "must be >= 1")
        require(self.code_memory_mb >= 64, "code_memory_mb", "must be >= 64 (the interpreter needs it)")
        require(self.code_max_processes >= 1, "code_max_processes", "must be >= 1")
        require(self.code_file_mb >= 1, "code_file_mb", "must be >= 1")
