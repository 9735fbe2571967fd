"""Start embedded servers as child processes (local runs, tests, benchmarks)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.netutil import free_port
from megatron_areal.server.sglang_launcher import start_server, stop_server


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
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
