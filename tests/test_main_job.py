"""The main job end to end: ``megatron-areal train`` on a tiny random Llama, a few steps.

One real run (an embedded rollout server and a trainer, started by the local launcher) is shared
by the checks below: every TensorBoard tag the run promises is written, the trained groups obey
the staleness bound, the configured number of steps was trained and checkpointed, and the
launcher leaves nothing running. A config typo is refused before any process starts.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_areal.util.netutil import free_port, port_free

STEPS = 3
ETA = 2
BATCH = 2  # groups (prompts) per step
GROUP = 4  # samples per prompt
RUN_TIMEOUT_S = 600  # generous: CI's two cores are shared by other tests' processes

REQUIRED_TAGS = (
    "rollout/reward_mean", "rollout/staleness_mean", "rollout/staleness_max", "rollout/interrupted_fraction",
    "rollout/dropped_stale", "train/loss", "train/clip_fraction", "train/importance_weight_mean",
    "train/grad_norm", "perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s",
    "perf/trainer_idle_fraction", "perf/generator_idle_fraction", "perf/train_all_tokens_per_s",
    "perf/trainer_peak_rss_gb", "eval/accuracy",
)
FRACTION_TAGS = ("rollout/interrupted_fraction", "train/clip_fraction", "perf/trainer_idle_fraction",
                 "perf/generator_idle_fraction", "eval/accuracy")


def tiny_config(run_dir: Path) -> dict:
    return {
        "train": {"run_dir": str(run_dir), "steps": STEPS, "eval_every": 0, "seed": 3},
        "model": {"path": "tiny-llama", "max_seq_len": 256},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": BATCH, "group_size": GROUP, "max_new_tokens": 16, "max_concurrent": 8,
                    "temperature": 1.0,
                    "filter_equal_rewards": False},  # a random model earns no reward; keep every group
        "staleness": {"eta": ETA},
        "server": {"count": 1, "max_running": 16, "base_port": free_port()},
        "cluster": {"master_port": free_port(), "stop_grace_s": 5},
        "data": {"train": "arithmetic", "train_size": 256, "eval": "arithmetic-eval", "eval_size": 8},
        "reward": {"workers": 1},
        "checkpoint": {"every": 2, "keep": 1},
        "logging": {"progress": False},
    }


def train(config: Path, *overrides: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_areal.cli", "train", str(config), *overrides]
    started = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the launcher stops its servers and trainer on the way out
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"train did not finish within {timeout:.0f} s:\n{err[-3000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    done.started, done.ended = started, time.time()  # the command's span on the wall clock
    return done


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("main_job")
    cfg = tiny_config(root / "run")
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = train(path)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "run/logs").glob("*.log")))
    assert result.returncode == 0, f"train failed ({result.returncode}):\n{result.stderr[-3000:]}\n{logs}"
    return cfg, root / "run", result


@pytest.mark.slow
def test_every_tensorboard_tag_is_written(run: tuple) -> None:
    _, run_dir, _ = run
    scalars = read_scalars(run_dir / "tensorboard")
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, f"tags missing from {run_dir / 'tensorboard'}: {missing}; written: {sorted(scalars)}"

    # Per-step tags carry one value per trained step; held-out accuracy is measured before and after.
    for tag in REQUIRED_TAGS:
        if tag != "eval/accuracy":
            assert [s for s, _ in scalars[tag]] == list(range(1, STEPS + 1)), tag
    assert [s for s, _ in scalars["eval/accuracy"]] == [0, STEPS]
    for tag in FRACTION_TAGS:
        assert all(0.0 <= v <= 1.0 for _, v in scalars[tag]), (tag, scalars[tag])
    for tag in ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s",
                "perf/train_all_tokens_per_s", "perf/trainer_peak_rss_gb"):
        assert all(v > 0 for _, v in scalars[tag]), (tag, scalars[tag])
    assert all(0 <= v <= ETA for _, v in scalars["rollout/staleness_max"])
    means, maxes = dict(scalars["rollout/staleness_mean"]), dict(scalars["rollout/staleness_max"])
    assert all(means[s] <= maxes[s] for s in means)
    assert all(v == 0 for _, v in scalars["rollout/dropped_stale"])  # the gate never over-submits


@pytest.mark.slow
def test_ledger_respects_eta_and_counts_steps(run: tuple) -> None:
    _, run_dir, _ = run
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == list(range(1, STEPS + 1))
    for entry in ledger:
        assert entry["version"] == entry["step"]
        assert len(entry["prompts"]) == BATCH and len(entry["staleness"]) == BATCH * GROUP, entry
        assert all(0 <= s <= ETA for s in entry["staleness"]), f"group older than eta={ETA}: {entry}"
    trained = [p for e in ledger for p in e["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice within the first epoch"
    # The last step is always checkpointed, and only the newest checkpoint is kept (keep: 1).
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{STEPS:08d}"]


@pytest.mark.slow
def test_launcher_leaves_nothing_running(run: tuple) -> None:
    _, run_dir, _ = run
    plan = json.loads((run_dir / "plan.json").read_text())
    ports = [s["port"] for s in plan["servers"]]
    assert ports and all(port_free("127.0.0.1", p) for p in ports), f"a server still holds its port: {ports}"
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["label"], e["n"]) for e in evals] == [(0, "before", 8), (STEPS, "after", 8)]


def test_config_typo_fails_before_anything_starts(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = train(path, "ppo.eps_clp=0.1", timeout=120)
    assert result.returncode != 0
    assert "ppo.eps_clp" in result.stderr and "eps_clip" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists(), "the run directory was created although the config is wrong"


@pytest.mark.slow
def test_each_evaluation_records_when_its_result_was_known(run: tuple) -> None:
    """bench/time_to_accuracy.py reads the time to an accuracy level from eval.jsonl on the same clock as a
    baseline's: each evaluation carries the wall-clock time inside the command's span, in order."""
    _, run_dir, result = run
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert all("time" in e for e in evals), f"an evaluation without its time: {evals}"
    times = [e["time"] for e in evals]
    assert result.started < times[0] <= times[-1] < result.ended, (result.started, times, result.ended)
    assert times == sorted(times), times


@pytest.mark.slow
def test_launcher_terminal_shows_each_step_and_the_accuracy(run: tuple) -> None:
    """The launcher's own output (not the trainer's log) has a progress line per step and ends
    with the held-out accuracy before -> after and the run directory."""
    _, run_dir, result = run
    out = result.stdout + result.stderr
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward " in out, f"no progress line for step {step}:\n{out[-3000:]}"
    evals = {e["label"]: e["accuracy"] for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}
    expected = f"held-out accuracy {100 * evals['before']:.1f}% -> {100 * evals['after']:.1f}%"
    assert expected in out and f"run directory: {run_dir}" in out, out[-3000:]


@pytest.mark.slow
def test_run_writes_a_timeline_that_adds_up(run: tuple) -> None:
    """timeline.json and its summary (megatron_areal/rundir/timeline.py): a valid Chrome trace in which every role's
    activities tile its wall time, with the trainer's phases, each weight push and the servers' work on it."""
    from test_timeline import assert_run_timeline

    _, run_dir, _ = run
    assert_run_timeline(run_dir, STEPS)
