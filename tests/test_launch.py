"""The local launcher: real servers and trainer processes, stopped together on Ctrl-C or failure."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from netutil import free_ports

from megatron_areal.config import load_config
from megatron_areal.launch.local import local_plan
from megatron_areal.launch.procs import ProcessSet
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import ServerSlot
from megatron_areal.run.registry import wait_for_servers
from megatron_areal.util.netutil import port_free

ROOT = Path(__file__).resolve().parents[1]


def procs_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:  # the process ended while it was read
            continue
    return found


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def start_launcher(run_dir: Path, *overrides: str, config: Path = ROOT / "configs/train_tiny.yaml",
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    base, master = free_ports(2)
    cmd = [sys.executable, "-m", "megatron_areal.cli", "train", str(config),
           f"train.run_dir={run_dir}", f"server.base_port={base}", f"cluster.master_port={master}",
           "cluster.stop_grace_s=5", "train.steps=50", *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def servers_registered(run_dir: Path, count: int) -> bool:
    reg = run_dir / "servers"
    return reg.is_dir() and len([f for f in reg.iterdir() if not f.name.startswith(".")]) == count


def assert_all_stopped(run_dir: Path) -> None:
    """No process of the run is left, and every port of its plan can be bound again."""
    left = procs_mentioning(str(run_dir))
    assert not left, [p.info["cmdline"] for p in left]
    plan = json.loads((run_dir / "plan.json").read_text())
    ports = [s["port"] for s in plan["servers"]] + [plan["trainer"]["master_port"]]
    assert all(port_free("127.0.0.1", p) for p in ports), ports


@pytest.fixture(scope="module", autouse=True)
def _model(tiny_llama: Path) -> None:
    """Prepare the tiny model once so the launcher does not spend the test's time converting it."""


def test_sigint_stops_servers_and_torchrun_trainer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(run_dir, "cluster.cpu_dp=2")  # torchrun with two workers in their own sessions
    try:
        wait_until(lambda: servers_registered(run_dir, 2), 120, "two servers to register")
        trainer = wait_until(lambda: [p for p in procs_mentioning(str(run_dir / "plan.json"))], 30, "the trainer")
        assert any("torch.distributed.run" in " ".join(p.cmdline()) for p in trainer)
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, out
    assert "SIGINT received" in out
    assert_all_stopped(run_dir)
    assert not any((run_dir / "servers").iterdir())  # servers unregistered themselves
    logs = {f.name for f in (run_dir / "logs").iterdir()}
    assert {"server-0.log", "server-1.log", "trainer.log"} <= logs


def test_run_stops_when_no_server_is_left(tmp_path: Path) -> None:
    """A dead server is restarted (tests/test_server_restart.py); past server.max_restarts it is given
    up, and with none left the launcher stops the run and everything it started."""
    run_dir = tmp_path / "run"
    launcher = start_launcher(run_dir, "server.max_restarts=0")
    try:
        wait_until(lambda: servers_registered(run_dir, 2), 120, "two servers to register")
        # once the launcher admitted them (each proved it is this run's) and started the trainer
        wait_until(lambda: procs_mentioning(str(run_dir / "plan.json")), 60, "the trainer")
        for f in list((run_dir / "servers").iterdir()):
            os.kill(json.loads(f.read_text())["pid"], signal.SIGKILL)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode != 0, out
    assert "none could be restarted" in out, out
    assert_all_stopped(run_dir)


def test_stop_all_reaches_torchrun_workers_and_sigterm_ignorers(tmp_path: Path) -> None:
    procs = ProcessSet(tmp_path / "logs", grace_s=1.0)
    procs.start("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--no-python",
                             "sleep", "300"])
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(300)"
    procs.start("stubborn", [sys.executable, "-c", stubborn])
    root = procs.children[0].pid
    sleepers = wait_until(lambda: s if len(s := _sleepers(root)) == 2 else None, 60, "two torchrun workers")
    assert all(os.getsid(p.pid) != os.getsid(root) for p in sleepers)  # why killing torchrun's group is not enough
    wait_until(lambda: "up" in (tmp_path / "logs" / "stubborn.log").read_text(), 30, "the stubborn child")
    tree = [psutil.Process(c.pid) for c in procs.children] + sleepers
    start = time.monotonic()
    procs.stop_all()
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert time.monotonic() - start < 10
    assert procs.children[1].returncode() == -signal.SIGKILL  # ignored SIGTERM, killed after the grace


def _sleepers(root: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(root).children(recursive=True) if c.cmdline() == ["sleep", "300"]]
    except psutil.NoSuchProcess:
        return []


def test_registration_wait_names_what_is_missing(tmp_path: Path) -> None:
    reg = tmp_path / "servers"
    reg.mkdir()
    slots = [ServerSlot("n2-0", "n2", "10.0.0.2", 30000, ()), ServerSlot("n2-1", "n2", "10.0.0.2", 30010, ())]
    (reg / "n2-0").write_text(json.dumps({"url": "http://10.0.0.2:30000"}))
    with pytest.raises(LaunchError) as e:
        wait_for_servers(reg, slots, timeout_s=0.3, poll_s=0.05)
    msg = str(e.value)
    assert str(reg) in msg and "n2-1 (http://10.0.0.2:30010)" in msg and "missing" in msg
    assert "n2-0 (" not in msg.split("registered:")[0]
    # a server known dead ends the wait at once, with its story
    start = time.monotonic()
    with pytest.raises(LaunchError, match="server n2-1 exited with code 1"):
        wait_for_servers(reg, slots, timeout_s=60, failure=lambda: "server n2-1 exited with code 1")
    assert time.monotonic() - start < 5
    # registered under another file name: matched by address
    (reg / "host-30010").write_text(json.dumps({"url": "http://10.0.0.2:30010/"}))
    assert wait_for_servers(reg, slots, timeout_s=1) == ["http://10.0.0.2:30000", "http://10.0.0.2:30010"]


def test_busy_ports_move_to_free_ones() -> None:
    base, master = free_ports(2)
    with socket.socket() as busy, socket.socket() as busy_master:
        busy.bind(("127.0.0.1", base))
        busy.listen()
        busy_master.bind(("127.0.0.1", master))
        busy_master.listen()
        overrides = [f"server.base_port={base}", f"cluster.master_port={master}"]
        cfg = load_config(ROOT / "configs/train_tiny.yaml", overrides)
        plan = local_plan(cfg)
    ports = [s.port for s in plan.servers]
    assert base not in ports and ports[1] == base + cfg.cluster.server_port_stride
    assert plan.trainer.master_port != master
    assert len(set(ports + [plan.trainer.master_port])) == 3


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """Even SIGKILL of the launcher (no cleanup runs) leaves no child behind."""
    script = ("import sys, time\nfrom pathlib import Path\nfrom megatron_areal.launch.procs import ProcessSet\n"
              "procs = ProcessSet(Path(sys.argv[1]))\nprocs.start('sleeper', ['sleep', '300'])\n"
              "print(procs.children[0].pid, flush=True)\ntime.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    sleeper = psutil.Process(int(launcher.stdout.readline()))
    assert sleeper.is_running()
    launcher.kill()
    launcher.wait()
    wait_until(lambda: not sleeper.is_running() or sleeper.status() == psutil.STATUS_ZOMBIE, 10,
               "the child of a killed launcher to end")


def _cmdlines_with(secret: str, skip: set[int]) -> list[str]:
    """Command lines of every process on this machine (not only the run's) that contain ``secret``."""
    hits = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in skip:
            continue
        try:
            argv = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if secret.encode() in argv:
            words = argv.replace(bytes(1), b" ").decode(errors="replace")
            hits.append(f"{proc.name}: {words}")
    return hits


def _files_with(secret: str, root: Path) -> list[str]:
    return [str(f) for f in root.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]


def _status(url: str, key: str | None) -> int:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("route", ["yaml", "env", "override"])
def test_api_key_never_in_argv_or_logs(tmp_path: Path, route: str) -> None:
    """The key given in the config file, in MEGATRON_AREAL_API_KEY or as a command-line override reaches
    every server and the trainer (a step is trained against servers that refuse requests without it),
    yet no process's argv (``/proc/PID/cmdline``, readable by every user) and no file of the run holds it.
    Only the launcher's own argv may, when the user typed the key there (route "override")."""
    import yaml

    key = f"sk-{uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    config, env, overrides = ROOT / "configs/train_tiny.yaml", {}, []
    if route == "yaml":
        data = yaml.safe_load((ROOT / "configs/train_tiny.yaml").read_text())
        data["server"]["api_key"] = key
        config = tmp_path / "with_key.yaml"
        config.write_text(yaml.safe_dump(data))
    elif route == "env":
        env = {"MEGATRON_AREAL_API_KEY": key}
    else:
        overrides = [f"server.api_key={key}"]
    launcher = start_launcher(run_dir, *overrides, "checkpoint.every=0", config=config, env=env)
    try:
        wait_until(lambda: servers_registered(run_dir, 2), 120, "two servers to register")
        metrics = run_dir / "metrics.jsonl"

        def trained() -> bool:
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
            return metrics.is_file() and "train/loss" in metrics.read_text()

        wait_until(trained, 240, "the trainer to train a step with the key")
        url = json.loads(next((run_dir / "servers").iterdir()).read_text())["url"]
        assert (_status(url, None), _status(url, key)) == (401, 200)
        assert not _cmdlines_with(key, skip={launcher.pid} if route == "override" else set())
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert key not in out
    assert not _files_with(key, run_dir)
    logs = list((run_dir / "logs").glob("*.log"))
    assert logs and all(f.stat().st_mode & 0o777 == 0o600 for f in logs), \
        {f.name: oct(f.stat().st_mode & 0o777) for f in logs}


def test_control_files_decide_each_step_boundary(tmp_path: Path) -> None:
    from megatron_areal.run import control

    assert control.decide(tmp_path, 1) == "go"
    hold = control.control_dir(tmp_path) / "hold"
    hold.parent.mkdir()
    hold.write_text("2")
    assert [control.decide(tmp_path, s) for s in (1, 2, 3)] == ["go", "hold", "go"]
    hold.write_text("")
    assert control.decide(tmp_path, 3) == "hold"  # empty: the next boundary
    control.request_checkpoint(tmp_path, "test")
    assert control.decide(tmp_path, 3) == "checkpoint"  # a held trainer still answers a request
    # rank 0 decides; the trainer saves, answers and stops; a requeued attempt forgets it all but the hold
    decisions = iter(["hold", "checkpoint"])
    saved = []
    stepper = control.StepControl(tmp_path, rank0=True, agree=lambda _: next(decisions), poll_s=0.01)
    assert stepper.stop_after(3, save=lambda: saved.append(3)) and saved == [3]
    assert control.saved_step(tmp_path) == 3
    control.clear_requests(tmp_path)
    assert control.saved_step(tmp_path) is None and control.decide(tmp_path, 4) == "hold"


def test_slurm_time_left_parsing() -> None:
    from megatron_areal.launch.slurm import parse_time_left

    assert parse_time_left("9:58") == 598 and parse_time_left("1:00:00") == 3600
    assert parse_time_left("2-01:00:05") == 2 * 86400 + 3605
    assert parse_time_left("UNLIMITED") is None and parse_time_left("") is None


def test_api_key_overrides_never_reach_children() -> None:
    from megatron_areal.run.secrets import API_KEY_ENV, apply_env_api_key, env_with_api_key, public_overrides

    assert public_overrides(["train.steps=3", "server.api_key=sk-1", " server.api_key =x"]) == ["train.steps=3"]
    cfg = load_config(ROOT / "configs/train_tiny.yaml", ["server.api_key=sk-yaml"])
    assert apply_env_api_key(cfg, {}).server.api_key == "sk-yaml"
    assert apply_env_api_key(cfg, {API_KEY_ENV: "sk-env"}).server.api_key == "sk-env"
    assert env_with_api_key({API_KEY_ENV: "old", "A": "1"}, None) == {"A": "1"}
    assert env_with_api_key({}, "k") == {API_KEY_ENV: "k"}


def test_trainer_that_asks_to_resume_is_requeued(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A weight push lost over NCCL: the trainer saved its step and wrote ``control/resume``; the Slurm
    batch step requeues the job (no USR1 involved), and a new attempt starts with the request cleared."""
    import logging

    from megatron_areal.launch.slurm import RequeueOnUsr1, _requeue_if_asked
    from megatron_areal.run.control import ask_to_resume, clear_requests, resume_asked

    usr1 = RequeueOnUsr1(tmp_path, grace_s=10, job=None)
    with caplog.at_level(logging.WARNING):
        assert _requeue_if_asked(usr1, 1, tmp_path) == 1  # a plain failure is not requeued
        ask_to_resume(tmp_path, 7, "weights v7: transfer over NCCL failed")
        assert _requeue_if_asked(usr1, 1, tmp_path) == 0
    assert "requeueing job None: the trainer saved step 7 and stopped: weights v7" in caplog.text
    clear_requests(tmp_path)
    assert resume_asked(tmp_path) is None
