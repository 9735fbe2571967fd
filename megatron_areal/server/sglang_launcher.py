"""Start an SGLang server for one rollout node and wait until it answers ``/health``.

The same wait logic serves the embedded server (``megatron-areal serve``), which is how it is
tested on machines where SGLang cannot be installed.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


@dataclass(kw_only=True)
class SGLangLaunch:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp: int = 1
    mem_fraction: float | None = 0.85
    api_key: str | None = field(default=None, repr=False)  # never printed: see key_config
    weight_version: str | None = None
    seed: int | None = None
    context_length: int | None = None
    max_running: int | None = None
    extra_args: tuple[str, ...] = ()
    _key_file: str | None = field(default=None, init=False, repr=False, compare=False)

    def command(self, python: str = sys.executable) -> list[str]:
        """``python -m sglang.launch_server`` with the flags a rollout node needs.

        ``--dp-size 1``: weight updates over NCCL assume one data-parallel replica per server. The API
        key is not a flag: see ``key_config``.
        """
        cmd = [python, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--tp-size", str(self.tp), "--dp-size", "1", "--host", self.host, "--port", str(self.port)]
        optional = {"--mem-fraction-static": self.mem_fraction, "--config": self.key_config(),
                    "--weight-version": self.weight_version, "--random-seed": self.seed,
                    "--context-length": self.context_length, "--max-running-requests": self.max_running}
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + list(self.extra_args)

    def key_config(self) -> str | None:
        """A YAML file, readable by its owner only, that gives SGLang its API key.

        SGLang 0.5.23 takes the key from ``--api-key`` or from ``--config FILE.yaml`` and reads no
        environment variable for it; ``--config`` is merged into the arguments in memory
        (``ConfigArgumentMerger`` in ``sglang/srt/utils/server_args_config_parser.py``), so the key
        never shows in ``/proc/PID/cmdline``. One file per spec, written on first use."""
        if not self.api_key:
            return None
        if self._key_file is None:
            fd, path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".yaml")  # mode 0600
            with os.fdopen(fd, "w") as f:
                # the merger makes "--<key>" of each key as written; a JSON string is a YAML string
                f.write(f"api-key: {json.dumps(str(self.api_key))}\n")
            self._key_file = path
        return self._key_file

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def tail(path: str | Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(url: str, *, timeout_s: float, proc: subprocess.Popen | None = None,
                 log_path: str | Path | None = None, poll_s: float = 0.5) -> None:
    """Poll ``url/health`` until 200; fail fast if ``proc`` exits, with the log's tail."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"server for {url} exited with code {proc.returncode} before becoming healthy; "
                              f"last log lines of {log_path}:\n{tail(log_path) if log_path else ''}")
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
    detail = f"; last log lines of {log_path}:\n{tail(log_path)}" if log_path else ""
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
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch_sglang(spec: SGLangLaunch, log_path: str | Path, *, timeout_s: float = 600.0) -> subprocess.Popen:
    return start_server(spec.command(), spec.url, log_path, timeout_s=timeout_s)
