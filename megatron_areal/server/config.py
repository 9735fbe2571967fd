"""Settings of the rollout servers, and the one place that holds their defaults.

``EngineOptions`` are the options of one embedded inference engine (``megatron-areal serve`` leaves
every flag that is not given at these defaults); ``ServerConfig`` is the run's ``server`` section,
which takes its per-server defaults from ``EngineOptions``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_areal.configbase import require

# The longest KV slot the embedded engine sets up when no context length is given: its cache holds
# max_running x context_length tokens from the start, and a model's whole window (8,192 tokens for
# SmolLM2) would make it four times as large as most rollouts need.
DEFAULT_CONTEXT_LENGTH = 2048
# A weight version is copied into every sequence's reply (``meta_info.weight_version``): at most this
# many characters, from the command line or a client.
MAX_VERSION_CHARS = 256


@dataclass(kw_only=True)
class EngineOptions:
    """One embedded engine (``server/engine.Engine``): how many sequences it decodes together, how
    long each may be, how many may wait, and where it runs."""

    max_running: int = 32  # sequences decoded together: the KV cache's slots, allocated at start
    max_queue: int = 1024  # waiting requests before 503
    context_length: int | None = None  # tokens per KV slot (prompt + output); None: see context_length_for
    max_prefill_tokens: int = 8192
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on CUDA
    step_stall_s: float = 120.0  # a model step running longer than this turns /health to 503
    weight_version: str = "default"
    weight_group_timeout_s: float = 300.0  # joining a weight-update group, and each of its collectives
    health_timeout_s: float = 20.0  # /health while paused waits this long, then answers 503 (SGLang: 20 s)
    weight_load_timeout_s: float = 600.0  # reading a weights folder from disk; past it the load fails
    max_request_tokens: int = 2**18  # output tokens one /generate may ask for (prompts x n x max_new_tokens)

    def context_length_for(self, max_position_embeddings: int) -> int:
        """Tokens per KV slot for a model: ``context_length`` when given (even past the model's
        window), else the model's ``max_position_embeddings`` up to ``DEFAULT_CONTEXT_LENGTH``."""
        return self.context_length or min(max_position_embeddings, DEFAULT_CONTEXT_LENGTH)


@dataclass(kw_only=True)
class ServerConfig:
    """The run's rollout fleet: which engine, how many servers, where, and each server's limits. The
    launcher gives each embedded server the run's seed (``train.seed``), dtype (``model.dtype``) and
    device (the plan's), so they are not set here."""

    engine: Literal["embedded", "sglang", "vllm"] = "embedded"
    count: int = 1  # rollout servers
    tp: int = 1  # tensor-parallel size of each server
    host: str = "127.0.0.1"
    base_port: int = 30000
    api_key: str | None = None
    max_running: int = EngineOptions.max_running  # sequences decoded together (SGLang: --max-running-requests)
    max_queue: int = EngineOptions.max_queue  # waiting requests before 503 (embedded)
    context_length: int | None = None  # tokens per sequence (prompt + output); None: model.max_seq_len
    mem_fraction: float = 0.85  # SGLang --mem-fraction-static
    threads: int = 1  # embedded server: torch threads per server process
    startup_timeout_s: float = 600.0
    # a server that dies during the run is started again on the same port, at most this many times
    # (each), after restart_backoff_s, doubling per restart of the same server; then it is dropped
    max_restarts: int = 3
    restart_backoff_s: float = 2.0
    extra_args: list[str] = field(default_factory=list)  # appended to the server command line
    # the Python that runs SGLang or vLLM servers (another environment, e.g. scripts/install_vllm.sh's
    # .venv-vllm/bin/python); None: this one
    python: str | None = None

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.count >= 1, "count", "must be >= 1")
        require(self.tp >= 1, "tp", "must be >= 1")
        require(self.engine != "embedded" or self.tp == 1, "tp", "the embedded server runs tp=1 only")
        require(self.max_running >= 1, "max_running", "must be >= 1")
        require(self.max_queue >= 1, "max_queue", "must be >= 1")
        require(self.context_length is None or self.context_length >= 2, "context_length", "must be >= 2")
        require(0 < self.mem_fraction <= 1, "mem_fraction", "must be in (0, 1]")
        require(1 <= self.base_port <= 65535, "base_port", "must be a TCP port")
        require(self.threads >= 1, "threads", "must be >= 1")
        require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        require(self.restart_backoff_s >= 0, "restart_backoff_s", "must be >= 0")
        require(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")

