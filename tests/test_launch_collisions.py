"""Two jobs on one machine: a run binds only ports it checked, admits only servers it started, and ends, naming
the port, when another process takes one from under it.

Real processes throughout: the launcher, its embedded servers and trainer, and as the other job a plain
listening socket or an HTTP server on the planned port.
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from netutil import free_port_range, free_ports
from test_launch import procs_mentioning, wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/train_tiny.yaml"
# the calculator agent on the tiny model: its trainer starts the held-out episodes before its process group
# (still under way when the process group fails: 64 episodes of up to two 32-token turns)
AGENT = ("rollout.workflow=megatron_areal.agent.calculator_task:run_episode", "data.train=calculator",
         "data.eval=calculator-eval", "data.eval_size=64", "rollout.max_turns=2", "model.max_seq_len=1024",
         "rollout.max_episode_tokens=1024", "rollout.max_new_tokens=32")


def launch(run_dir: Path, base: int, master: int, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_areal.cli", "train", str(TINY), f"train.run_dir={run_dir}",
           f"server.base_port={base}", f"cluster.master_port={master}", "cluster.stop_grace_s=5", "train.steps=50",
           *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@contextmanager
def listening(port: int) -> Iterator[socket.socket]:
    """Another process's listener on ``port`` (all addresses, as torch's TCP store binds)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))
        s.listen()
        yield s


@contextmanager
def foreign_http_server(port: int) -> Iterator[list[str]]:
    """A plain HTTP server (not this run's) that answers 200 to everything; yields the paths it was asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            asked.append(self.path)
            if "sk-run-secret" in str(self.headers):
                asked.append(f"the API key was sent with {self.path}")
            body = json.dumps({"ok": True, "weight_version": "default"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        server.shutdown()
        server.server_close()


def assert_nothing_left(run_dir: Path) -> None:
    left = wait_until(lambda: not procs_mentioning(str(run_dir)) or None, 15, "the run's processes to go")
    assert left


@pytest.fixture(scope="module", autouse=True)
def _model(tiny_llama: Path) -> None:
    """Prepare the tiny model once so the launcher does not spend the test's time converting it."""


@pytest.mark.parametrize("overrides", [(), AGENT], ids=["single-turn", "agent"])
def test_rendezvous_port_taken_after_the_check_ends_the_run_naming_it(tmp_path: Path, overrides: tuple) -> None:
    """The port is free when the launcher plans and checks it, and taken once the trainer process exists (it
    binds it seconds later, after its imports): the trainer's ``init_process_group`` fails, and the whole run
    must end within a minute saying which port, instead of hanging or saying only "exited with code 1"."""
    run_dir = tmp_path / "run"
    base, master = free_port_range(20), free_ports(1)[0]
    launcher = launch(run_dir, base, master, *overrides)
    try:
        wait_until(lambda: procs_mentioning(str(run_dir / "plan.json")), 180, "the trainer process")
        with listening(master):
            try:
                out, _ = launcher.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("the run did not end within 60 s of its trainer losing the rendezvous port")
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode != 0, out
    last = out.strip().splitlines()[-3:]
    assert any(str(master) in line and "rendezvous" in line for line in last), out[-3000:]
    assert_nothing_left(run_dir)


# ---- only the run's own servers are admitted ------------------------------------------------------------


def _plan_in_a_process(config: Path, base: int, master: int, hold_s: float) -> subprocess.Popen:
    """Another launcher planning this machine's ports (and holding them for ``hold_s``), as a real process."""
    script = ("import json, sys, time\nfrom megatron_areal.config import load_config\n"
              "from megatron_areal.launch.local import local_plan\nfrom megatron_areal.launch.ports import PortClaims\n"
              f"cfg = load_config({str(config)!r}, ['server.base_port={base}', 'cluster.master_port={master}'])\n"
              "claims = PortClaims()\nplan = local_plan(cfg, claims)\n"
              "print(json.dumps([s.port for s in plan.servers] + [plan.trainer.master_port]), flush=True)\n"
              f"time.sleep({hold_s})\n")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_two_launchers_planning_at_once_get_disjoint_ports() -> None:
    """Two jobs started at the same moment plan while neither has bound anything yet: every port must differ
    (before, both planned the same free ports and the later binder failed)."""
    base, master = free_port_range(20), free_ports(1)[0]
    jobs = [_plan_in_a_process(TINY, base, master, hold_s=20) for _ in range(2)]
    try:
        planned = [json.loads(job.stdout.readline()) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    assert len(planned[0]) == len(planned[1]) == 3, planned
    assert not set(planned[0]) & set(planned[1]), planned
    assert base in planned[0] + planned[1] and master in planned[0] + planned[1]  # one of them kept the plan


def test_vllm_watcher_does_not_register_another_jobs_server(tmp_path: Path) -> None:
    """The vLLM watcher registers a server once its port answers. Here the port answers, but from another job's
    server (a plain HTTP server saying 200 to everything): nothing may be registered."""
    from megatron_areal.util.run_identity import NONCE_ENV, new_nonce

    port = free_ports(1)[0]
    reg = tmp_path / "servers"
    reg.mkdir()
    ours = subprocess.Popen(["sleep", "60"])  # stands for our vLLM process, which failed to bind but not yet exited
    with foreign_http_server(port) as asked:
        watcher = subprocess.Popen([sys.executable, "-m", "megatron_areal.launch.vllm_register", str(reg), "vm-0",
                                    f"http://127.0.0.1:{port}", str(ours.pid), "m"],
                                   env={**os.environ, NONCE_ENV: new_nonce()})
        try:
            wait_until(lambda: list(reg.iterdir()) or len(asked) >= 3, 30, "the watcher to probe the port")
            assert not list(reg.iterdir()), [f.read_text() for f in reg.iterdir()]
        finally:
            ours.kill()
            ours.wait()
            watcher.wait(timeout=30)


def test_registry_admits_only_a_server_that_proves_the_nonce(tmp_path: Path, tiny_llama: Path) -> None:
    """Registrations for two slots: one is a real embedded server started with this run's nonce, the other
    address is held by a foreign HTTP server. The wait admits the first and times out naming the second."""
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.run.errors import LaunchError
    from megatron_areal.run.plan import ServerSlot
    from megatron_areal.run.registry import wait_for_servers
    from megatron_areal.util.run_identity import NONCE_ENV, new_nonce

    nonce = new_nonce()
    reg = tmp_path / "servers"
    reg.mkdir()
    foreign_port = free_ports(1)[0]
    os.environ[NONCE_ENV] = nonce  # what the launcher hands its servers
    try:
        server = start_embedded(tiny_llama)
    finally:
        del os.environ[NONCE_ENV]
    with server, foreign_http_server(foreign_port) as asked:
        port = int(server.url.rsplit(":", 1)[1])
        slots = [ServerSlot("a-0", "a", "127.0.0.1", port, ()), ServerSlot("a-1", "a", "127.0.0.1", foreign_port, ())]
        for slot in slots:
            (reg / slot.id).write_text(json.dumps({"url": slot.url}))
        assert wait_for_servers(reg, slots[:1], timeout_s=30, nonce=nonce) == [server.url]
        with pytest.raises(LaunchError) as e:
            wait_for_servers(reg, slots, timeout_s=3, nonce=nonce, poll_s=0.2)
        assert f"127.0.0.1:{foreign_port}" in str(e.value) and "not a server this run started" in str(e.value)
        # another run's real server (another nonce) is refused as well
        with pytest.raises(LaunchError, match="another run's proof"):
            wait_for_servers(reg, slots[:1], timeout_s=2, nonce=new_nonce(), poll_s=0.2)
    assert all(path.startswith("/run_identity?") for path in asked), asked


def test_trainer_client_sends_nothing_keyed_to_a_server_that_is_not_the_runs(tmp_path: Path) -> None:
    """The rollout client's re-admission probes (``health``, ``alive``) and the first call of a weight push
    (``pause``) ask for the proof first, without the key: a foreign server gets no request carrying the API
    key, is not admitted, and is not paused."""
    import asyncio

    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.util.run_identity import NONCE_ENV, new_nonce

    port = free_ports(1)[0]

    async def probe() -> tuple[bool, bool, str]:
        async with RolloutClient(f"http://127.0.0.1:{port}", api_key="sk-run-secret") as client:
            try:
                await client.pause()  # the first call of a weight push
                paused = "paused"
            except ServerError as e:
                paused = str(e)
            return await client.health(2), await client.alive(2), paused

    os.environ[NONCE_ENV] = new_nonce()
    try:
        with foreign_http_server(port) as asked:
            health, alive, paused = asyncio.run(probe())
            assert (health, alive) == (False, False) and "not a server this run started" in paused
    finally:
        del os.environ[NONCE_ENV]
    assert asked and all(p.startswith("/run_identity?") for p in asked), asked


def test_a_weight_push_sends_nothing_keyed_to_a_stranger_on_a_members_port(tmp_path: Path) -> None:
    """A member that died may have left its port to another process. The first calls of every sync to a member
    (the pause, and the check whether it was restarted) ask for the proof first, without the key: the stranger
    gets no request carrying the API key, and the pause fails naming it."""
    import asyncio

    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.util.run_identity import NONCE_ENV, new_nonce
    from megatron_areal.weights.push import pause_member

    port = free_ports(1)[0]

    async def pause() -> str:
        async with RolloutClient(f"http://127.0.0.1:{port}", api_key="sk-run-secret") as client:
            try:
                return f"paused: {await pause_member(client, 'abort', '3')}"
            except ServerError as e:
                return str(e)

    os.environ[NONCE_ENV] = new_nonce()
    try:
        with foreign_http_server(port) as asked:
            outcome = asyncio.run(pause())
    finally:
        del os.environ[NONCE_ENV]
    assert "not a server this run started" in outcome, outcome
    assert asked and all(p.startswith("/run_identity?") for p in asked), asked


# ---- every process ends when its main work fails; the launcher ends what stopped making progress --------

LINGERING_RANK = """
import os, sys, threading, time
from megatron_areal.rundir.layout import heartbeat_path
from megatron_areal.trainer.exit import run_rank, start_heartbeat

def main():
    start_heartbeat(heartbeat_path(sys.argv[1], 0), interval_s=0.2)
    threading.Thread(target=time.sleep, args=(600,), name="held-out evaluation").start()  # not a daemon
    time.sleep(float(sys.argv[2]))
    raise OSError("The server socket has failed to listen: port 29500 EADDRINUSE, address already in use")

run_rank(main) if sys.argv[3] == "guarded" else main()
"""


def test_a_rank_whose_main_work_fails_exits_despite_its_threads(tmp_path: Path) -> None:
    """The trainer's failure path, in a real process: a non-daemon thread still runs when ``init_process_group``
    raises. Unguarded (what the trainer did) the process stays; under ``run_rank`` it exits with code 1 at once
    and says which port was taken and which thread it did not wait for."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    plain = subprocess.Popen([sys.executable, "-c", LINGERING_RANK, str(tmp_path), "0", "plain"], env=env,
                             stderr=subprocess.DEVNULL)
    guarded = subprocess.Popen([sys.executable, "-c", LINGERING_RANK, str(tmp_path), "0", "guarded"], env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        _, err = guarded.communicate(timeout=30)
        assert guarded.returncode == 1, err
        assert "rendezvous port 127.0.0.1:29500" in err and "held-out evaluation" in err, err
        with pytest.raises(subprocess.TimeoutExpired):  # the reference: without the guard it hangs
            plain.wait(timeout=5)
    finally:
        for p in (plain, guarded):
            p.kill()
            p.wait()


def test_launcher_names_a_rank_whose_heartbeat_stopped(tmp_path: Path) -> None:
    """A rank whose main thread ended while its process stays (the unguarded case above) stops touching its
    heartbeat: the launcher's check names it once the bound has passed, and not before."""
    from megatron_areal.launch.heartbeats import TrainerHeartbeats

    watch = TrainerHeartbeats(tmp_path, range(1), timeout_s=2.0)
    rank = subprocess.Popen([sys.executable, "-c", LINGERING_RANK, str(tmp_path), "3", "plain"],
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "heartbeats" / "trainer-rank0").exists(), 30, "the first heartbeat")
        assert watch.stuck() is None  # beating
        stuck = wait_until(watch.stuck, 30, "the heartbeat to go stale")
        assert rank.poll() is None  # the process is still there: only the heartbeat tells
        assert "rank0" in stuck and "no heartbeat" in stuck, stuck
    finally:
        rank.kill()
        rank.wait()


def test_a_frozen_server_is_named_and_killed(tmp_path: Path, tiny_llama: Path) -> None:
    """A real embedded server of the run, frozen (SIGSTOP: alive, answering nothing): the watch names it after
    the bound; the keeper then sees it exit and restarts it."""
    import signal

    from megatron_areal.launch.procs import ProcessSet, ServerKeeper
    from megatron_areal.launch.server_watch import ServerWatch
    from megatron_areal.run.plan import ServerSlot
    from megatron_areal.util.run_identity import NONCE_ENV, identity_problem, new_nonce

    nonce, port = new_nonce(), free_ports(1)[0]
    slot = ServerSlot("vm-0", "vm", "127.0.0.1", port, ())
    procs = ProcessSet(tmp_path / "logs", grace_s=1)
    child = procs.start("server-0", [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(tiny_llama),
                                     "--port", str(port)], {**os.environ, NONCE_ENV: nonce})
    try:
        wait_until(lambda: identity_problem(slot.url, nonce, 2) is None, 120, "the server", poll_s=0.5)
        keeper = ServerKeeper(procs, {"server-0": child}, {"server-0": "vm-0"}, max_restarts=1, backoff_s=0.1)
        watch = ServerWatch(keeper, {"server-0": slot}, nonce, timeout_s=3, startup_s=120, interval_s=0.5).start()
        time.sleep(2)
        assert watch.stalled() == []
        os.kill(child.pid, signal.SIGSTOP)
        stalled = wait_until(watch.stalled, 30, "the frozen server to be named")
        assert stalled[0][0] == "server-0" and "vm-0" in stalled[0][1] and str(child.pid) in stalled[0][1]
        procs.kill(child)
        wait_until(lambda: (keeper.poll(), keeper.total_restarts)[1] == 1, 30, "the restart")
        watch.stop()
    finally:
        procs.stop_all()


def test_two_jobs_started_together_on_the_same_ports_both_train(tmp_path: Path) -> None:
    """Two main jobs, the same config and ports, started at the same moment: both train (one of them moved to
    other ports), each with its own servers, or one stops at once saying which port."""
    base, master = free_port_range(20), free_ports(1)[0]
    runs = [tmp_path / "a", tmp_path / "b"]
    jobs = [launch(run, base, master, "train.steps=1", "server.count=1", "checkpoint.every=0") for run in runs]
    outs = []
    try:
        for job in jobs:
            outs.append(job.communicate(timeout=420)[0])
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    for job, run, out in zip(jobs, runs, outs, strict=True):
        if job.returncode != 0:
            assert "port" in "\n".join(out.strip().splitlines()[-3:]), out[-3000:]
            continue
        assert (run / "metrics.jsonl").is_file(), out[-3000:]
    assert sum(job.returncode == 0 for job in jobs) >= 1, [o[-2000:] for o in outs]
    plans = [json.loads((run / "plan.json").read_text()) for run in runs]
    ports = [{s["port"] for s in p["servers"]} | {p["trainer"]["master_port"]} for p in plans]
    assert not ports[0] & ports[1], ports


def test_vllm_middleware_answers_the_identity_challenge_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM has no ``/run_identity``; the middleware the launcher always installs answers it, keyless, with
    HMAC-SHA256 under the nonce of its environment, and without reaching vLLM."""
    import asyncio
    import hashlib
    import hmac

    from megatron_areal.util.run_identity import NONCE_ENV
    from megatron_areal.vllm_plugin.admin_key import AdminKeyMiddleware

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    monkeypatch.setenv(NONCE_ENV, "n" * 32)
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/run_identity", "root_path": "", "headers": [],
             "query_string": b"challenge=abc123"}
    asyncio.run(AdminKeyMiddleware(app)(scope, None, send))
    assert sent[0]["status"] == 200 and not reached
    expected = hmac.new(b"n" * 32, b"abc123", hashlib.sha256).hexdigest()
    assert json.loads(sent[1]["body"]) == {"proof": expected}


def test_dry_run_names_a_configured_port_that_is_busy_here(tiny_llama: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A second job's ``--dry-run`` while the first trains: the rendezvous port it would plan is in use."""
    from megatron_areal.launch.cli import main as train_main

    master = free_ports(1)[0]
    with listening(master):
        train_main([str(TINY), "--dry-run", f"cluster.master_port={master}"])
    out = capsys.readouterr().out
    assert any(line.startswith("warning: ") and f"port {master} (cluster.master_port) is busy" in line
               for line in out.splitlines()), out
