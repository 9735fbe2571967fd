"""Settings of training checkpoints (see ``megatron_areal.checkpoint.training``)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import directory_problem, require


@dataclass(kw_only=True)
class CheckpointConfig:
    """Training checkpoints: how often, how many are kept, whether a run resumes, and where they go."""

    every: int = 0  # steps between checkpoints; 0 disables
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from the newest checkpoint in the checkpoint directory
    dir: str = ""  # where step_<N> directories go; empty: RunDir.checkpoints (rundir/layout.py)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.every >= 0, "every", "must be >= 0")
        require(self.keep >= 1, "keep", "must be >= 1")
        problem = directory_problem(self.dir) if self.dir else None
        require(problem is None, "dir", str(problem))
