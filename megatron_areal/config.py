"""The one configuration tree of a run.

Each section is a dataclass owned by the component that reads it; this module only assembles
them. ``load_config("run.yaml", ["ppo.eps_clip=0.1"])`` returns a validated ``Config``; any typo
or bad value raises ``ConfigError`` naming the dotted key and suggesting the closest valid one.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_areal.algorithm.config import PPOConfig
from megatron_areal.checkpoint.config import CheckpointConfig
from megatron_areal.cluster.config import ClusterConfig
from megatron_areal.cluster.sim_config import SimConfig
from megatron_areal.configbase import (
    ConfigError,
    apply_overrides,
    directory_problem,
    from_dict,
    load_yaml,
    require,
    to_dict,
)
from megatron_areal.data.config import DataConfig
from megatron_areal.reward.config import RewardConfig
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.server.config import ServerConfig
from megatron_areal.weights.config import WeightsConfig

__all__ = ["Config", "ConfigError", "LoggingConfig", "TrainConfig", "load_config", "to_dict"]


@dataclass(kw_only=True)
class LoggingConfig:
    """How a run reports: TensorBoard events, how often, and a terminal progress bar."""

    tensorboard: bool = True
    log_every: int = 1
    progress: bool = True  # a progress bar on the terminal

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.log_every >= 1, "log_every", "must be >= 1")


@dataclass(kw_only=True)
class TrainConfig:
    """The run as a whole: its directory, how many policy updates, how often to evaluate, the seed."""

    run_dir: str = "runs/default"
    steps: int = 20  # policy updates
    eval_every: int = 0  # steps between held-out evaluations; 0: only before and after
    seed: int = 1

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.steps >= 0, "steps", "must be >= 0")
        require(self.eval_every >= 0, "eval_every", "must be >= 0")
        require(bool(self.run_dir), "run_dir", "must not be empty")
        problem = directory_problem(self.run_dir)
        require(problem is None, "run_dir", f"{problem}: the run writes its servers, logs and checkpoints there")


@dataclass(kw_only=True)
class Config:
    """The whole configuration of a run: one section per component, each validated at load."""

    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def validate(self) -> None:
        """Checks across sections (each section validates itself first)."""
        require(not self.ppo.routing_replay or self.rollout.return_routed_experts, "ppo.routing_replay",
                "true requires rollout.return_routed_experts: true (the rollout's routes are what the trainer replays)")
        require(not (self.model.lora.enabled and self.weights.verify), "weights.verify",
                "does not yet cover a model.lora run's push (the checksums are of the base weights' shards); "
                "set weights.verify: false")
        require(not (self.model.lora.enabled and self.weights.transfer == "shards"), "weights.transfer",
                "shards is not offered for a model.lora run: the stage heads push its adapters (merged weights to "
                "SGLang); "
                "use stage_heads or auto")
        require(not (self.model.lora.enabled and self.parallel.sequence_parallel), "parallel.sequence_parallel",
                "is not supported with model.lora (the adapters take the projection's whole input)")
        if self.weights.method == "disk" and self.weights.disk_dir:
            problem = directory_problem(self.weights.disk_dir)
            require(problem is None, "weights.disk_dir", str(problem))
        if self.rollout.workflow:
            problem = workflow_problem(self.rollout.workflow)
            require(problem is None, "rollout.workflow", str(problem))
        require(not self.weights.verify or self.server.engine != "sglang", "weights.verify",
                "true is not offered for server.engine=sglang: SGLang's /weights_checker hashes its own fused, "
                "tensor-parallel parameters (with a GPU kernel), which the trainer cannot recompute from the HF "
                "tensors it pushes; set weights.verify: false")
        longest = min(self.server.context_length or self.model.max_seq_len, self.model.max_seq_len)
        require(self.rollout.max_new_tokens < longest, "rollout.max_new_tokens",
                f"({self.rollout.max_new_tokens}) leaves no room for a prompt in sequences of {longest} tokens "
                "(model.max_seq_len, server.context_length): every request would be refused")


def workflow_problem(spec: str) -> str | None:
    """Why ``spec`` is not an agent the rollout can run - importable, ``async def f(task, client)`` - else None.
    Imports the user's module, as the trainer will."""
    import inspect

    from megatron_areal.agent.workflow import WorkflowError, load_workflow

    try:
        fn = load_workflow(spec)
    except WorkflowError as e:
        return str(e).removeprefix("rollout.workflow: ")
    except Exception as e:  # noqa: BLE001 - the user's module raised on import: say what
        return f"importing {spec.partition(':')[0]!r} raised {type(e).__name__}: {str(e)[:200]}"
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return f"{spec} must take two arguments (task, client)"
    except ValueError:  # no signature to read (a builtin): not a function of the user's
        return f"{spec} must be an async function (task, client)"
    return None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """A validated ``Config`` from a YAML file (or the defaults) and ``key=value`` overrides; errors name the
    dotted key and the file."""
    data = renamed_sections(load_yaml(path) if path else {}, str(path or "the defaults"))
    data = apply_overrides(Config, data, [renamed_override(o) for o in overrides or []])
    try:
        return from_dict(Config, data)
    except ConfigError as e:
        if path:
            raise ConfigError(f"{path}: {e}") from None
        raise


# Sections renamed, old name -> new; the old name is still read for one release, with a warning.
RENAMED_SECTIONS = {"realloc": "weights"}


def _deprecated(old: str, new: str, where: str) -> None:
    warnings.warn(f"{where}: the config section '{old}:' is now '{new}:' ('{old}' is read for one more release; "
                  f"rename it)", FutureWarning, stacklevel=3)


def renamed_sections(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` with every renamed section under its new name; both names at once is an error."""
    for old, new in RENAMED_SECTIONS.items():
        if old in data:
            if new in data:
                raise ConfigError(f"{where}: both '{old}:' and '{new}:' are given; '{old}' is the old name "
                                  f"of '{new}', keep only '{new}:'")
            _deprecated(old, new, where)
            data = {(new if k == old else k): v for k, v in data.items()}
    return data


def renamed_override(text: str) -> str:
    """``realloc.x=v`` -> ``weights.x=v`` (with the warning); other overrides unchanged."""
    for old, new in RENAMED_SECTIONS.items():
        if text.startswith(old + "."):
            _deprecated(old, new, f"override {text.split('=', 1)[0]!r}")
            return new + text[len(old):]
    return text
