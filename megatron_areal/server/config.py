"""Settings of the rollout fleet (embedded servers or SGLang)."""
from __future__ import annotations

from dataclasses import dataclass
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
    mem_fraction: float = 0.85  # SGLang --mem-fraction-static
    startup_timeout_s: float = 600.0

    def validate(self) -> None:
        require(self.count >= 1, "count", "must be >= 1")
        require(self.tp >= 1, "tp", "must be >= 1")
        require(self.max_running >= 1, "max_running", "must be >= 1")
