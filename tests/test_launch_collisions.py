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

import psutil
import pytest
from netutil import free_port_range, free_ports

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/train_tiny.yaml"
# the calculator agent on the tiny model: its trainer starts the held-out episodes before its process group
# (still under way when the process group fails: 64 episodes of up to two 32-token turns)
AGENT = ("rollout.workflow=megatron_areal.agent.calculator_task:run_episode", "data.train=calculator",
         "data.eval=calculator-eval", "data.eval_size=64", "rollout.max_turns=2", "model.max_seq_len=1024",
         "rollout.max_episode_tokens=1024", "rollout.max_new_tokens=32")


def procs_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


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
