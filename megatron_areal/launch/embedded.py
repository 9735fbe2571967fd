"""The embedded server as a child process of this one (tests, benchmarks, ``megatron-areal eval``).

A run's servers are started by the launcher instead (``launch/local.py``, ``launch/node_role.py``).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.launch.commands import cpu_thread_env
from megatron_areal.launch.server_process import start_server, stop_server
from megatron_areal.util.netutil import free_port


@dataclass
class LocalServer:
    """A running embedded server: its process, URL and log; a context manager that stops it.

    ``temp_dir`` is the folder made for the log when the caller named none: it goes when the server is
    stopped, and stays (with the log) when the server had died on its own.
    """

    proc: subprocess.Popen
    url: str
    log_path: Path
    temp_dir: Path | None = None

    def stop(self) -> None:
        """Stop the server process (SIGTERM, then SIGKILL) and reap it."""
        died_on_its_own = self.proc.poll() is not None
        stop_server(self.proc)
        if self.temp_dir is not None and not died_on_its_own:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded(model: str | Path, *, args: list[str] | None = None, host: str = "127.0.0.1",
                   port: int | None = None, log_path: str | Path | None = None, timeout_s: float = 120.0,
                   threads: int = 1) -> LocalServer:
    """``megatron-areal serve --model MODEL ARGS`` on a free port; returns once healthy."""
    port = port or free_port(host)
    temp_dir = None
    if log_path is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="embedded-server-"))
        log_path = temp_dir / "server.log"
    cmd = [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(model), "--host", host,
           "--port", str(port), *(args or [])]
    url = f"http://{host}:{port}"
    env = cpu_thread_env(threads, shares_cores=False)  # a server on its own cores
    proc = start_server(cmd, url, log_path, timeout_s=timeout_s, env=env)
    return LocalServer(proc=proc, url=url, log_path=Path(log_path), temp_dir=temp_dir)
