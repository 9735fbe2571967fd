"""The run directory (``train.run_dir``): the one place that names every file a run writes.

Layout, with the module that writes each entry::

    RUN_DIR/
      plan.json          RunDir.plan         the launcher's plan (run/plan.py); every role reads it
      servers/           RunDir.servers      one registration per healthy rollout server (run/registry.py)
      logs/              RunDir.logs         <process>.log per child (launch/procs.py); under Slurm also
                                             {rollout,trainer}-<node>.log of the node agents
      control/           RunDir.control      requests to the trainer: checkpoint, hold, and its answers
                                             saved, held (run/control.py)
      checkpoints/       RunDir.checkpoints  step_<N>/ (checkpoint/training.py); ``checkpoint.dir`` moves it
      metrics.jsonl      RunDir.metrics      one line of scalars per step (metrics.py)
      eval.jsonl         RunDir.evals        held-out accuracy per evaluation (metrics.py)
      trained.jsonl      RunDir.trained      which prompts each step trained, with staleness (ledger.py)
      tensorboard/       RunDir.tensorboard  TensorBoard events of the same scalars (metrics.py)
      timeline.json      RunDir.timeline     every role's activity as a Chrome trace (timeline.py)
      timeline_summary.json  RunDir.timeline_summary  seconds per activity per role (timeline.py)

The Slurm scripts (``slurm/*.sh``) name the same paths in their comments only.
tests/test_rundir.py checks that no other module of the package spells these names.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    """Paths of one run. ``checkpoint_dir`` is ``checkpoint.dir`` (empty: ``RUN_DIR/checkpoints``).
    Nothing is created here: each writer makes what it writes."""

    root: Path
    checkpoint_dir: str | Path = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def of(cls, cfg: Any) -> RunDir:
        """The run directory of a config (``train.run_dir``, ``checkpoint.dir``)."""
        return cls(cfg.train.run_dir, cfg.checkpoint.dir)

    def resolved(self) -> RunDir:
        """The same run with an absolute root, for paths handed to other processes."""
        return RunDir(self.root.resolve(), self.checkpoint_dir)

    @property
    def plan(self) -> Path:
        """The launcher's plan, read by every role."""
        return self.root / "plan.json"

    @property
    def servers(self) -> Path:
        """One registration file per healthy rollout server."""
        return self.root / "servers"

    @property
    def logs(self) -> Path:
        """One log per child process."""
        return self.root / "logs"

    @property
    def control(self) -> Path:
        """Requests to the trainer (checkpoint, hold) and its answers."""
        return self.root / "control"

    @property
    def checkpoints(self) -> Path:
        """``checkpoint.dir`` when set, else ``RUN_DIR/checkpoints``."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        """One JSON line of scalars per step."""
        return self.root / "metrics.jsonl"

    @property
    def evals(self) -> Path:
        """One JSON line per held-out evaluation."""
        return self.root / "eval.jsonl"

    @property
    def trained(self) -> Path:
        """Which prompts each step trained, with their staleness."""
        return self.root / "trained.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard events of the same scalars."""
        return self.root / "tensorboard"

    @property
    def timeline(self) -> Path:
        """Every role's activity over the run, as a Chrome trace."""
        return self.root / "timeline.json"

    @property
    def timeline_summary(self) -> Path:
        """Seconds per activity per role, and the run's wall time."""
        return self.root / "timeline_summary.json"


def heartbeat_path(run_dir: str | Path, rank: int | str) -> Path:
    """The file trainer rank ``rank`` touches while its main thread runs."""
    return Path(run_dir) / "heartbeats" / f"trainer-rank{rank}"
