"""One rollout server as a child process: start it, wait until its ``/health`` answers, stop it.

Used for an SGLang server under a node role (``node_role``) and for the embedded server started by
tests, benchmarks and ``megatron-areal eval`` (``launch/embedded.py``), which is how the wait is
tested where SGLang cannot be installed.
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_areal.launch.procs import log_tail
from megatron_areal.run.errors import LaunchError

log = logging.getLogger(__name__)


def wait_healthy(url: str, *, timeout_s: float, proc: subprocess.Popen | None = None,
                 log_path: str | Path | None = None, poll_s: float = 0.5) -> None:
    """Poll ``url/health`` until 200; fail fast if ``proc`` exits, with the log's tail."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"server for {url} exited with code {proc.returncode} before becoming healthy; "
                              f"last log lines of {log_path}:\n{log_tail(log_path, 30) if log_path else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
        time.sleep(poll_s)
    detail = f"; last log lines of {log_path}:\n{log_tail(log_path, 30)}" if log_path else ""
    raise LaunchError(f"server {url} not healthy after {timeout_s:.0f}s (last: {last}){detail}")


def start_server(cmd: list[str], url: str, log_path: str | Path, *, timeout_s: float,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` with output to ``log_path``; return once ``url`` is healthy (or raise and stop it)."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log.info("started %s (pid %d), waiting for %s/health", " ".join(cmd[:4]), proc.pid, url)
    try:
        wait_healthy(url, timeout_s=timeout_s, proc=proc, log_path=log_path)
    except LaunchError:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
