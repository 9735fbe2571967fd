"""What one trainer rank saw of a push, and how every rank's view is combined (identically on all ranks)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Outcome:
    """One rank's part of a push: the servers that failed and what was sent, with where the time went."""

    errors: dict[str, str] = field(default_factory=dict)  # url -> what failed
    bytes_sent: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    # time on the busiest rank: gathering/converting/packing, the wire, waiting for installs
    gather_seconds: float = 0.0
    broadcast_seconds: float = 0.0
    reply_seconds: float = 0.0
    wire_bytes: list[int] = field(default_factory=list)  # shard push: bytes each trainer rank sent, in rank order
    peak_buffer_bytes: int = 0  # shard push: the most bucket memory one rank held at once


def combine(parts: Iterable[Outcome]) -> Outcome:
    """Every rank's outcome, in rank order, as one: errors and bytes added up, times and peaks the largest."""
    total = Outcome()
    for part in parts:
        total.errors.update(part.errors)
        total.bytes_sent += part.bytes_sent
        total.buckets += part.buckets
        total.max_bucket_bytes = max(total.max_bucket_bytes, part.max_bucket_bytes)
        total.gather_seconds = max(total.gather_seconds, part.gather_seconds)
        total.broadcast_seconds = max(total.broadcast_seconds, part.broadcast_seconds)
        total.reply_seconds = max(total.reply_seconds, part.reply_seconds)
        total.wire_bytes += part.wire_bytes
        total.peak_buffer_bytes = max(total.peak_buffer_bytes, part.peak_buffer_bytes)
    return total
