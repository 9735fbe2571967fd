"""What the launcher's terminal shows of a run, read from the run directory as the trainer writes it.

The trainer may be on another node and its own progress bar goes to its log; the launcher tails
``RUN_DIR/metrics.jsonl`` instead and prints one line per trained step (reward, staleness,
throughput, ETA), then the held-out accuracy before and after from ``RUN_DIR/eval.jsonl``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from megatron_areal.rundir.layout import RunDir
from megatron_areal.rundir.metrics import read_eval

STEP_KEY = "perf/step_time_s"  # present in a trained step's record, absent from evaluation records


class RunProgress:
    def __init__(self, run_dir: str | Path, total_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir, self.total_steps, self._clock = Path(run_dir), total_steps, clock
        self._offset = 0
        self._started: tuple[float, int] | None = None  # (time, step) of the first step seen

    def poll(self) -> list[str]:
        """Lines for the steps logged since the last call (complete lines only)."""
        path = RunDir(self.run_dir).metrics
        if not path.is_file():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        lines = []
        for raw in complete.splitlines():
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if STEP_KEY in record:
                lines.append(self._line(record))
        return lines

    def _line(self, r: dict) -> str:
        step, now = int(r["step"]), self._clock()
        if self._started is None:
            self._started = (now - float(r[STEP_KEY]), step - 1)
        t0, step0 = self._started
        eta = (now - t0) / max(step - step0, 1) * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for label, key, fmt in (("reward", "rollout/reward_mean", "{:.3f}"), ("staleness", "rollout/staleness_mean",
                                                                              "{:.2f}"),
                                ("train tok/s", "perf/train_tokens_per_s", "{:.0f}"),
                                ("gen tok/s", "perf/gen_tokens_per_s", "{:.0f}")):
            if key in r:
                parts.append(f"{label} {fmt.format(r[key])}")
        parts.append(f"ETA {_duration(eta)}")
        return " | ".join(parts)

    def summary(self, wall_s: float | None = None) -> str:
        """The run's closing line: held-out accuracy before -> after, with the gain per minute of ``wall_s``
        (the command's wall time) when given, and where the run lives."""
        before, after = read_eval(self.run_dir, "before"), read_eval(self.run_dir, "after")
        where = f"run directory: {self.run_dir}"
        if before is None or after is None:
            return f"no held-out accuracy recorded; {where}"
        gain = 100 * (after - before)
        per_minute = f" in {_duration(wall_s)}: {gain / (wall_s / 60):+.2f} points/min" if wall_s else ""
        return f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% ({gain:+.1f} points{per_minute}); {where}"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"
