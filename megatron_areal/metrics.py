"""Run metrics: TensorBoard scalars and a terminal progress bar, written by trainer rank 0."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Writes ``{tag: value}`` per step to TensorBoard (``RUN_DIR/tensorboard``) and to
    ``RUN_DIR/metrics.jsonl`` (one line per step, easy to read without TensorBoard), and keeps a
    progress bar showing step, reward and throughput."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
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
