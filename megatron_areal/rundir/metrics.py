"""Run metrics: TensorBoard scalars and a terminal progress bar, written by trainer rank 0."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from tqdm import tqdm

from megatron_areal.rundir.layout import RunDir

logger = logging.getLogger(__name__)


def truncate_after(path: str | Path, step: int) -> None:
    """Cut a ``{"step": ...}`` JSONL file back to the records with ``step <= step``: on resume from a
    checkpoint, the steps an abandoned run logged after it are dropped. A line that does not parse
    (one cut short by a kill) is dropped too. Rewritten through a temp file and ``os.replace``, so a
    crash here leaves either the old file or the new one."""
    path = Path(path)
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            keep = int(record["step"]) <= step
        except (ValueError, TypeError, KeyError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        logger.info("%s: dropped %d record(s) after step %d (from before the resume)", path, dropped, step)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_eval(run_dir: str | Path, record: dict) -> None:
    """Append one evaluation (``{"step", "label", "accuracy", "n", "time"}``) to ``RUN_DIR/eval.jsonl``."""
    with open(RunDir(run_dir).evals, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_eval(run_dir: str | Path, label: str) -> float | None:
    """The accuracy of the latest evaluation with this label in ``RUN_DIR/eval.jsonl`` (a resumed
    run reads back its "before" figure), or None."""
    path = RunDir(run_dir).evals
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("label") == label and record.get("accuracy") is not None:
            found = float(record["accuracy"])
    return found


class MetricsWriter:
    """Writes ``{tag: value}`` per step to TensorBoard (``RUN_DIR/tensorboard``) and to
    ``RUN_DIR/metrics.jsonl`` (one line per step, easy to read without TensorBoard), and keeps a
    progress bar showing step, reward and throughput.

    A run resumed from step ``start_step`` > 0 keeps what the checkpointed run logged up to that
    step and drops what an abandoned run logged after it (``metrics.jsonl``, ``eval.jsonl`` and,
    through ``purge_step``, TensorBoard); a run starting at step 0 starts all three afresh (its
    "before" evaluation is run again)."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        paths = RunDir(self.run_dir)
        keep_through = start_step if start_step > 0 else -1
        truncate_after(paths.metrics, keep_through)
        truncate_after(paths.evals, keep_through)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(paths.tensorboard), purge_step=keep_through + 1)
        self._jsonl = open(paths.metrics, "a")
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, disable=not progress)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}
        if self._tb is not None:
            for tag, value in clean.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()

    def advance(self, step: int, scalars: dict[str, float]) -> None:
        """Log the step's scalars and move the progress bar, showing the headline figures."""
        self.log(step, scalars)
        shown = {"reward": "rollout/reward_mean", "loss": "train/loss", "gen_tok/s": "perf/gen_tokens_per_s",
                 "train_tok/s": "perf/train_tokens_per_s"}
        self._bar.set_postfix({k: f"{scalars[t]:.3g}" for k, t in shown.items() if t in scalars}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
