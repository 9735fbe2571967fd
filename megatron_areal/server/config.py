"""Settings of the rollout fleet (embedded servers or SGLang)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class ServerConfig:
    engine: Literal["embedded", "sglang"] = "embedded"
    count: int = 1  # rollout servers
    tp: int = 1  # tensor-parallel size of each server
    host: str = "127.0.0.1"
    base_port: int = 30000
    api_key: str | None = None
    max_running: int = 64  # sequences decoded together (KV slots of the embedded server)
    max_queue: int = 1024  # waiting requests before 503
    context_length: int | None = None  # prompt + output tokens; None: the model's, capped at 2048 (embedded)
    mem_fraction: float = 0.85  # SGLang --mem-fraction-static
    device: str = "cpu"  # embedded server: cpu | cuda | cuda:N
    dtype: str | None = None  # embedded server: None = float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    threads: int = 1  # embedded server: torch threads per server process
    startup_timeout_s: float = 600.0
    # a server that dies during the run is started again on the same port, at most this many times
    # (each), after restart_backoff_s, doubling per restart of the same server; then it is dropped
    max_restarts: int = 3
    restart_backoff_s: float = 2.0
    extra_args: list[str] = field(default_factory=list)  # appended to the server command line

    def validate(self) -> None:
        require(self.count >= 1, "count", "must be >= 1")
        require(self.tp >= 1, "tp", "must be >= 1")
        require(self.engine == "sglang" or self.tp == 1, "tp", "the embedded server runs tp=1 only")
        require(self.max_running >= 1, "max_running", "must be >= 1")
        require(self.max_queue >= 1, "max_queue", "must be >= 1")
        require(self.context_length is None or self.context_length >= 2, "context_length", "must be >= 2")
        require(0 < self.mem_fraction <= 1, "mem_fraction", "must be in (0, 1]")
        require(self.dtype in (None, "float32", "bfloat16", "float16"), "dtype",
                "must be float32, bfloat16 or float16")
        require(1 <= self.base_port <= 65535, "base_port", "must be a TCP port")
        require(self.threads >= 1, "threads", "must be >= 1")
        require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        require(self.restart_backoff_s >= 0, "restart_backoff_s", "must be >= 0")


def embedded_args(cfg: ServerConfig, *, weight_version: str | None = None) -> list[str]:
    """``megatron-areal serve`` flags (after --model/--host/--port) for one embedded server."""
    args = ["--max-running", str(cfg.max_running), "--max-queue", str(cfg.max_queue), "--seed", str(cfg.seed),
            "--device", cfg.device]
    optional = {"--api-key": cfg.api_key, "--context-length": cfg.context_length, "--dtype": cfg.dtype,
                "--weight-version": weight_version}
    for flag, value in optional.items():
        if value is not None:
            args += [flag, str(value)]
    return args + list(cfg.extra_args)
