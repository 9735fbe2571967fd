"""Settings of the weight transfer from the trainer to the rollout servers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class WeightsConfig:
    """The weight push from the trainer to the servers: over a weight-update group or through a shared disk,
    bucket size, timeouts and retries."""

    method: Literal["distributed", "disk"] = "distributed"
    bucket_mb: float = 512.0  # HF-layout bytes per /update_weights_from_distributed call
    timeout_s: float = 120.0  # per collective op and per HTTP reply; a silent server is dropped after it
    master_address: str | None = None  # address servers reach the stage heads at; None: this host's
    disk_dir: str | None = None  # folder on a filesystem the servers share; required for method=disk
    # one broadcast per bucket (SGLang >= 0.5.23 and the embedded server); false: one per tensor
    flattened_bucket: bool = True
    max_retries: int = 1  # transfers repeated after dropping dead servers within one sync
    # /pause_generation mode: "abort" returns partial outputs (the controller resumes them),
    # "retract" re-queues them inside the server under the new weights
    pause_mode: Literal["abort", "retract"] = "abort"
    # after every push, every server's checksum of every tensor it installed is compared with the trainer's
    # (weights/verify.py); a mismatch stops the run naming the tensor, the server and the version. Embedded
    # and vLLM servers (on vLLM's CPU build only the embedding, norms and output layer); refused for SGLang
    verify: bool = False
    # how the bytes travel: "shards" (every trainer rank sends its own slices; the embedded server and
    # vLLM), "stage_heads" (each stage's head gathers and broadcasts whole tensors; what SGLang takes),
    # "auto": shards where the engine receives them, else stage heads
    transfer: Literal["auto", "shards", "stage_heads"] = "auto"
    buckets_in_flight: int = 2  # shard push: buckets per rank packed or on the wire at once (its memory)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.bucket_mb > 0, "bucket_mb", "must be > 0")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")
        require(self.max_retries >= 0, "max_retries", "must be >= 0")
        require(self.buckets_in_flight >= 1, "buckets_in_flight", "must be >= 1")
        require(self.method != "disk" or bool(self.disk_dir), "disk_dir", "is required when method is 'disk'")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes (at least one)."""
        return max(1, int(self.bucket_mb * (1 << 20)))
