"""slurm/train_tiny.sh on a real two-node Slurm (.ci/slurm_up.sh): a full run, and a cancelled one."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from netutil import free_port_range

from megatron_areal.config import load_config
from megatron_areal.util.netutil import free_port

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("sinfo") is None, reason="sinfo not found: Slurm is not installed here "
                       "(CI installs slurm-wlm and starts it with .ci/slurm_up.sh)"),
]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """The local cluster (a no-op when it is already up, as in CI)."""
    out = subprocess.run(["bash", str(ROOT / ".ci/slurm_up.sh")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f".ci/slurm_up.sh failed:\n{out.stdout}\n{out.stderr}"


def submit(run_dir: Path, *overrides: str) -> str:
    cfg = load_config(ROOT / "configs/train_tiny.yaml", list(overrides))
    span = cfg.server.count * cfg.cluster.server_port_stride
    base = free_port_range(span)
    master = free_port(avoid=range(base, base + span))
    cmd = ["sbatch", "--parsable", f"--output={run_dir.parent}/slurm-%j.log", "slurm/train_tiny.sh",
           f"train.run_dir={run_dir}", f"train.steps={STEPS}", f"server.base_port={base}",
           f"cluster.master_port={master}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out.stdout.strip().split(";")[0]


def job_field(job: str, key: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else ""


def wait_state(job: str, states: set[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_field(job, "JobState")
        if state in states:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} not in {states} after {timeout_s} s (state {job_field(job, 'JobState')})")


def job_processes(job: str) -> list[psutil.Process]:
    """Processes whose environment says they belong to the job."""
    marker = f"SLURM_JOB_ID={job}".encode()
    found = []
    for pid in psutil.pids():
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(psutil.Process(pid))
        except (OSError, psutil.NoSuchProcess):
            continue
    return found


def logs_of(run_dir: Path) -> str:
    parts = []
    for f in sorted(run_dir.parent.glob("slurm-*.log")) + sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def test_train_tiny_runs_to_completion(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = submit(run_dir)
    state = wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}, 240)
    assert (state, job_field(job, "ExitCode")) == ("COMPLETED", "0:0"), logs_of(run_dir)
    # both roles ran on their own node, and logged per role
    logs = {f.name for f in (run_dir / "logs").iterdir()}
    assert {"server-n2-0.log", "server-n2-1.log", "torchrun-n1.log", "srun-rollout.log", "srun-trainer.log"} <= logs
    # the configured steps were trained and reached TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, logs_of(run_dir)
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    steps = {e.step for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert max(steps) == STEPS and set(range(1, STEPS + 1)) <= steps, steps
    assert not job_processes(job)


def test_scancel_midway_leaves_no_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = submit(run_dir, "train.steps=1000")
    wait_state(job, {"RUNNING"}, 60)
    deadline = time.monotonic() + 150
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):  # midway: a step has been trained
        assert job_field(job, "JobState") == "RUNNING", logs_of(run_dir)
        assert time.monotonic() < deadline, "no step trained:\n" + logs_of(run_dir)
        time.sleep(0.5)
    running = [" ".join(p.cmdline()) for p in job_processes(job)]
    assert any("megatron_areal.cli serve" in c for c in running)
    assert any("-m megatron_areal.trainer " in c for c in running)
    subprocess.run(["scancel", job], check=True)
    wait_state(job, {"CANCELLED"}, 60)
    deadline = time.monotonic() + 60  # SIGTERM, then SIGKILL after the cluster's KillWait (10 s)
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [p.cmdline() for p in left if p.is_running()]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


def hold_at(run_dir: Path, step: int) -> Path:
    """Make the trainer stop at the boundary after ``step`` until the test removes the file: the job is
    then at a known step for as long as the test needs, however fast it trains."""
    hold = run_dir / "control" / "hold"
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text(str(step))
    return hold


def wait_held(job: str, run_dir: Path, step: int, timeout_s: float = 180) -> None:
    held = run_dir / "control" / "held"
    deadline = time.monotonic() + timeout_s
    while not (held.is_file() and json.loads(held.read_text() or "{}").get("step") == step):
        assert job_field(job, "JobState") in ("PENDING", "RUNNING"), logs_of(run_dir)
        assert time.monotonic() < deadline, f"trainer not holding at step {step}:\n" + logs_of(run_dir)
        time.sleep(0.5)


def release_and_finish(job: str, run_dir: Path, hold: Path) -> None:
    """The job is back in the queue: lift the hold, start it now (not after the requeue delay), let it end."""
    hold.unlink()
    # Not "now": slurmd revokes the requeued attempt's credential with one-second resolution, and a
    # new attempt launched within that second is killed ("Job credential revoked", FAILED 1:0).
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], check=True)
    state = wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 240)
    assert (state, job_field(job, "ExitCode"), job_field(job, "Restarts")) == ("COMPLETED", "0:0", "1"), \
        logs_of(run_dir)


def trained_steps(run_dir: Path) -> Counter:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Counter(m["step"] for m in lines if "train/loss" in m)


def test_requeued_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 5
    hold = hold_at(run_dir, 2)
    job = submit(run_dir, f"train.steps={steps}")
    wait_held(job, run_dir, 2)
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()  # checkpoint.every: 1
    subprocess.run(["scontrol", "requeue", job], check=True)  # what a node failure or preemption does
    wait_state(job, {"PENDING"}, 60)
    release_and_finish(job, run_dir, hold)
    batch_log = next(run_dir.parent.glob("slurm-*.log")).read_text()
    assert "attempt 1" in batch_log and "attempt 2" in batch_log
    trained = trained_steps(run_dir)
    assert set(trained) == set(range(1, steps + 1)), trained
    assert trained[1] == trained[2] == 1, f"steps before the checkpoint were trained again: {trained}"


def test_usr1_saves_a_checkpoint_then_requeues(tmp_path: Path) -> None:
    """``#SBATCH --signal=B:USR1@...`` before the time limit: the trainer saves a checkpoint at the next
    step boundary (here step 2, which periodic checkpoints would not have saved) and the job requeues
    itself; the next attempt trains steps 3.. only."""
    run_dir = tmp_path / "run"
    steps = 5
    hold = hold_at(run_dir, 2)
    job = submit(run_dir, f"train.steps={steps}", "checkpoint.every=100")
    wait_held(job, run_dir, 2)
    assert not (run_dir / "checkpoints" / "step_00000002").exists()
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)  # what --signal=B:USR1@T sends
    wait_state(job, {"PENDING"}, 120)
    assert json.loads((run_dir / "control" / "saved").read_text()) == {"step": 2}
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    release_and_finish(job, run_dir, hold)
    batch_log = next(run_dir.parent.glob("slurm-*.log")).read_text()
    assert "SIGUSR1" in batch_log and "attempt 2" in batch_log, batch_log
    trained = trained_steps(run_dir)
    assert set(trained) == set(range(1, steps + 1)) and set(trained.values()) == {1}, trained
