"""Settings of the training and evaluation data."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class DataConfig:
    train: str = "arithmetic"  # a JSONL file, or a built-in task name
    eval: str = "arithmetic-eval"
    eval_size: int = 200
    chat_template: bool = True
    seed: int = 0

    def validate(self) -> None:
        require(self.eval_size >= 0, "eval_size", "must be >= 0")
