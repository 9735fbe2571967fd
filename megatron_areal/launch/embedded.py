"""The embedded server as a child process of this one (tests, benchmarks, ``megatron-areal eval``).

A run's servers are started by the launcher instead (``launch/local.py``, ``launch/node_role.py``).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.launch.server_process import start_server, stop_server
from megatron_areal.netutil import free_port


@dataclass
class LocalServer:
    """A running embedded server: its process, URL and log; a context manager that stops it."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        """Stop the server process (SIGTERM, then SIGKILL) and reap it."""
        stop_server(self.proc)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded(model: str | Path, *, args: list[str] | None = None, host: str = "127.0.0.1",
                   port: int | None = None, log_path: str | Path | None = None, timeout_s: float = 120.0,
                   threads: int = 1) -> LocalServer:
    """``megatron-areal serve --model MODEL ARGS`` on a free port; returns once healthy."""
    port = port or free_port(host)
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="embedded-server-")) / "server.log"
    cmd = [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(model), "--host", host,
           "--port", str(port), *(args or [])]
    url = f"http://{host}:{port}"
    proc = start_server(cmd, url, log_path, timeout_s=timeout_s, env={"OMP_NUM_THREADS": str(threads)})
    return LocalServer(proc=proc, url=url, log_path=Path(log_path))
