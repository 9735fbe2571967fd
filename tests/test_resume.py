"""Kill-and-resume of the main job loses and repeats nothing.

A tiny-model run checkpoints every step. Once the ledger shows two trained steps the trainer is
killed with SIGKILL (no chance to clean up); the launcher must then stop the rollout server and
leave no process behind. The same command is run again: it resumes from the newest checkpoint,
finishes the configured steps, and the ledger (cut back to the checkpoint) lists every step
exactly once with no prompt trained twice. Every prompt the stream had handed out before the
checkpoint was either trained by then, or (buffered or in flight at the checkpoint) trained after
the resume, unless it was counted as dropped for staleness.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from megatron_areal.util.netutil import free_port

STEPS = 8
ETA = 1
BATCH = 2
TRAIN_SIZE = 64  # the whole run stays inside the first epoch, so any repeat is a double use
RUN_TIMEOUT_S = 600  # generous: CI's two cores are shared with other tests
KILL_AFTER_STEPS = 2


def write_config(root: Path) -> Path:
    cfg = {
        "train": {"run_dir": str(root / "run"), "steps": STEPS, "eval_every": 0, "seed": 5},
        "model": {"path": "tiny-llama", "max_seq_len": 256},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": BATCH, "group_size": 4, "max_new_tokens": 16, "max_concurrent": 8,
                    "temperature": 1.0, "filter_equal_rewards": False},
        "staleness": {"eta": ETA},
        "server": {"count": 1, "max_running": 16, "base_port": free_port()},
        "cluster": {"master_port": free_port(), "stop_grace_s": 5},
        "data": {"train": "arithmetic", "train_size": TRAIN_SIZE, "eval": "", "seed": 0},
        "reward": {"workers": 1},
        "checkpoint": {"every": 1, "keep": 2, "resume": True},
        "logging": {"progress": False},
    }
    path = root / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path, out: Path) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "megatron_areal.cli", "train", str(config)],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def read_ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    # The trainer may be writing the last line right now; only complete lines count.
    return [json.loads(line) for line in lines if line.endswith("}")]


def run_logs(root: Path) -> str:
    files = [root / "launcher-1.out", root / "launcher-2.out", *sorted((root / "run/logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in files if p.is_file())


def wait_for_steps(launcher: subprocess.Popen, root: Path, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(read_ledger(root / "run")) < n:
        assert launcher.poll() is None, f"the run ended before {n} steps:\n{run_logs(root)}"
        assert time.monotonic() < deadline, f"no {n} steps within {timeout_s:.0f} s:\n{run_logs(root)}"
        time.sleep(0.05)


def trainer_of(launcher: subprocess.Popen) -> tuple[psutil.Process, list[psutil.Process]]:
    """The trainer process and every process below the launcher (servers, trainer, its workers)."""
    launcher_proc = psutil.Process(launcher.pid)
    # Only a direct child: the trainer's forked workers (reward pool) carry the same command line.
    trainers = [p for p in launcher_proc.children() if "megatron_areal.trainer" in _cmdline(p)]
    procs = launcher_proc.children(recursive=True)
    assert len(trainers) == 1, [_cmdline(p) for p in procs]
    return trainers[0], procs


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper that exited meanwhile
        return ""


def survivors(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:  # is_running also compares the creation time, so a reused pid does not count
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def saved_state(run_dir: Path) -> tuple[int, dict]:
    """The newest finished checkpoint's step and its rollout state (stream position, buffer, in flight)."""
    from megatron.core import dist_checkpointing

    from megatron_areal.checkpoint.training import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None, "no finished checkpoint although two steps were trained"
    common = dist_checkpointing.load_common_state_dict(str(path))
    return int(common["step"]), common["extra"]["rollout"]


def handed_out(rollout: dict, data_cfg: dict) -> set[int]:
    """The prompts the stream had given to the controller when the state was saved."""
    from megatron_areal.data.config import DataConfig
    from megatron_areal.data.stream import PromptStream
    from megatron_areal.data.tasks import load_datasets

    stream_state = rollout["prompts"]
    assert stream_state["epoch"] == 0, stream_state
    prompts, _ = load_datasets(DataConfig(**data_cfg))
    stream = PromptStream(prompts, seed=stream_state["seed"], shuffle=stream_state["shuffle"])
    given = {p.index for p in stream.take(stream_state["position"])}
    return given - set(stream_state["pending"])  # pending: given back, not yet handed out again


def kill_trainer_mid_run(config: Path, root: Path) -> None:
    launcher = launch(config, root / "launcher-1.out")
    try:
        wait_for_steps(launcher, root, KILL_AFTER_STEPS, RUN_TIMEOUT_S)
        trainer, procs = trainer_of(launcher)
        os.kill(trainer.pid, signal.SIGKILL)
        rc = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:  # the test failed early: SIGTERM lets the launcher stop its children
            launcher.terminate()
            launcher.wait(timeout=60)
    assert rc != 0, "the launcher reported success although its trainer was killed"
    left = survivors(procs, timeout_s=30)
    assert not left, f"processes outlived the launcher: {[(p.pid, _cmdline(p)) for p in left]}"


@pytest.mark.slow
def test_kill_and_resume_loses_and_repeats_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    run_dir = tmp_path / "run"
    kill_trainer_mid_run(config, tmp_path)

    step, rollout = saved_state(run_dir)
    before = {e["step"]: e for e in read_ledger(run_dir)}
    assert KILL_AFTER_STEPS - 1 <= step < STEPS - ETA, f"killed too late to test the resume (checkpoint {step})"
    waiting = [g["prompt_index"] for g in rollout["buffer"]["groups"]] + list(rollout["requeue"])
    assert waiting, "nothing was buffered or in flight at the checkpoint; the re-queue is untested"

    second = launch(config, tmp_path / "launcher-2.out")
    try:
        rc = second.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if second.poll() is None:
            second.terminate()
            second.wait(timeout=60)
    assert rc == 0, run_logs(tmp_path)
    resumed = [line for line in (run_dir / "logs/trainer.log").read_text().splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and resumed[0].endswith(f"(step {step})"), f"the restart did not resume: {resumed}"

    ledger = read_ledger(run_dir)
    assert [e["step"] for e in ledger] == list(range(1, STEPS + 1)), "a step is missing or repeated"
    assert all(ledger[s - 1] == before[s] for s in range(1, step + 1)), "steps up to the checkpoint changed"
    assert all(0 <= s <= ETA for e in ledger for s in e["staleness"])
    trained = [p for e in ledger for p in e["prompts"]]
    assert len(trained) == len(set(trained)), f"a prompt was trained twice in the first epoch: {trained}"

    # Before the checkpoint the stream gave out exactly: what was trained, what waited in the
    # buffer, and what was in flight. The last two must all be trained after the resume.
    given = handed_out(rollout, {"train": "arithmetic", "train_size": TRAIN_SIZE, "eval": "", "seed": 0})
    trained_by_checkpoint = {p for e in ledger[:step] for p in e["prompts"]}
    assert given == trained_by_checkpoint | set(waiting)
    assert len(waiting) == len(set(waiting)) and not trained_by_checkpoint & set(waiting)
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    dropped = int(final["rollout/dropped_stale"]) + int(final["rollout/filtered_groups"])
    lost = set(waiting) - {p for e in ledger[step:] for p in e["prompts"]}
    assert len(lost) <= dropped, f"prompts in flight at checkpoint {step} never trained: {sorted(lost)}"
