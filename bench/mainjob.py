"""Run the main job (``megatron-areal train``) from a benchmark and read back what it recorded.

Shared by the benchmarks that compare runs of the main job by their held-out evaluations
(``train.eval_every``; each record in ``eval.jsonl`` carries the wall-clock ``time`` its result was
known) and per-step metrics: ``bench/time_to_accuracy.py``, ``bench/staleness_ablation.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.rundir.layout import RunDir
from megatron_areal.rundir.ledger import TrainedLedger


def train_command(config: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_areal.cli", "train", str(config), f"train.run_dir={run_dir}", *overrides]


def run_train(config: Path, run_dir: Path, overrides: list[str], timeout: float) -> float:
    """Run the main job to its end -> the command's wall time; exits with its log tail if it fails.
    Past ``timeout`` seconds the launcher gets SIGTERM (it stops its servers and trainer; the run
    resumes from its newest checkpoint when started again)."""
    t0 = time.monotonic()
    with subprocess.Popen(train_command(config, run_dir, overrides), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            _, err = proc.communicate(timeout=120)
            raise SystemExit(f"the main job did not finish within {timeout:.0f} s; logs in {RunDir(run_dir).logs}\n"
                             f"{err[-2000:]}") from None
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the main job failed ({proc.returncode}); logs in {RunDir(run_dir).logs}\n{err[-2000:]}")
    return wall


def stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM a command (the launcher stops its servers and trainer on the way out), SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@dataclass
class RunRecord:
    """What one run directory holds: per-step metrics, evaluations, and the trained-prompt ledger."""

    metrics: list[dict]
    evals: list[dict]
    trained: list[dict]

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord:
        run = RunDir(run_dir)
        return cls(_jsonl(run.metrics), _jsonl(run.evals), TrainedLedger.read(run.trained))

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of one per-step metric."""
        return [(r["step"], r[key]) for r in self.metrics if key in r]

    def eval_points(self) -> list[dict]:
        """Each held-out evaluation with the training seconds up to its step (sum of step times)."""
        step_s = dict(self.series("perf/step_time_s"))
        return [{"step": e["step"], "accuracy": e["accuracy"],
                 "train_s": sum(s for k, s in step_s.items() if k <= e["step"])} for e in self.evals]

    def staleness(self) -> list[int]:
        """Staleness of every trained sample (policy versions between its start and its step)."""
        return [s for entry in self.trained for s in entry["staleness"]]

    def finished(self, steps: int) -> bool:
        """The run trained ``steps`` steps and evaluated the final policy."""
        return any(e["step"] == steps and e.get("label") == "after" for e in self.evals)
