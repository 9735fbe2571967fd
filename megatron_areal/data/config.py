"""Settings of the training and evaluation data."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class DataConfig:
    """Where training and held-out prompts come from, how many, and how they are templated and ordered."""

    train: str = "arithmetic"  # a JSONL file, or a built-in task name (megatron_areal.data.BUILTIN_TASKS)
    train_size: int = 0  # prompts to load; 0: the whole dataset, or the generator's default size
    eval: str = "arithmetic-eval"
    eval_size: int = 200  # 0: the whole eval dataset
    chat_template: bool = True  # wrap prompts with the tokenizer's chat template
    shuffle: bool = True  # a fresh seeded order of the training prompts every epoch
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(bool(self.train), "train", "must name a built-in task or a JSONL file")
        require(self.train_size >= 0, "train_size", "must be >= 0")
        require(self.eval_size >= 0, "eval_size", "must be >= 0")
