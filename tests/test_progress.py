"""The launcher's progress lines, from a metrics file written as the trainer writes it."""
from __future__ import annotations

import json
from pathlib import Path

from megatron_areal.launch.progress import RunProgress
from megatron_areal.rundir.metrics import append_eval


def test_lines_per_step_skip_eval_records_and_torn_lines(tmp_path: Path) -> None:
    now = [100.0]
    progress = RunProgress(tmp_path, total_steps=4, clock=lambda: now[0])
    assert progress.poll() == []
    metrics = tmp_path / "metrics.jsonl"
    step = {"rollout/reward_mean": 0.25, "rollout/staleness_mean": 0.5, "perf/train_tokens_per_s": 12.4,
            "perf/step_time_s": 10.0}
    with open(metrics, "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
        f.write(json.dumps({"step": 1, **step}) + "\n")
        f.write('{"step": 2, "rollout/rew')  # the trainer is still writing this one
    assert progress.poll() == ["step 1/4 | reward 0.250 | staleness 0.50 | train tok/s 12 | ETA 0m30s"]
    now[0] = 110.0
    with open(metrics, "a") as f:
        f.write('ard_mean": 0.5, "perf/step_time_s": 10.0}\n')
    assert progress.poll() == ["step 2/4 | reward 0.500 | ETA 0m20s"]
    assert progress.poll() == []


def test_summary_reads_before_and_after(tmp_path: Path) -> None:
    progress = RunProgress(tmp_path, total_steps=2)
    assert progress.summary().startswith("no held-out accuracy recorded")
    append_eval(tmp_path, {"step": 0, "label": "before", "accuracy": 0.195, "n": 200})
    append_eval(tmp_path, {"step": 2, "label": "after", "accuracy": 0.295, "n": 200})
    assert progress.summary() == f"held-out accuracy 19.5% -> 29.5% (+10.0 points); run directory: {tmp_path}"
    assert progress.summary(wall_s=300.0) == (f"held-out accuracy 19.5% -> 29.5% (+10.0 points in 5m00s: "
                                              f"+2.00 points/min); run directory: {tmp_path}")
