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
from netutil import free_ports

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
    base, master = free_ports(2)
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
    assert any("megatron_areal.cli serve" in c for c in running) and any("trainer_main" in c for c in running)
    subprocess.run(["scancel", job], check=True)
    wait_state(job, {"CANCELLED"}, 60)
    deadline = time.monotonic() + 60  # SIGTERM, then SIGKILL after the cluster's KillWait (10 s)
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [p.cmdline() for p in left if p.is_running()]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


def test_requeued_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 5
    job = submit(run_dir, f"train.steps={steps}")
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step_00000002").is_dir():  # published atomically once complete
        assert job_field(job, "JobState") in ("PENDING", "RUNNING"), logs_of(run_dir)
        assert time.monotonic() < deadline, "no checkpoint of step 2:\n" + logs_of(run_dir)
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job], check=True)  # what a node failure or preemption does
    wait_state(job, {"PENDING"}, 60)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)  # skip requeue hold
    state = wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, 240)
    assert (state, job_field(job, "ExitCode"), job_field(job, "Restarts")) == ("COMPLETED", "0:0", "1"), \
        logs_of(run_dir)
    batch_log = next(run_dir.parent.glob("slurm-*.log")).read_text()
    assert "attempt 1" in batch_log and "attempt 2" in batch_log
    trained = Counter(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                      if "train/loss" in json.loads(line))
    assert set(trained) == set(range(1, steps + 1)), trained
    assert trained[1] == trained[2] == 1, f"steps before the checkpoint were trained again: {trained}"
