"""A shard push's traffic, cut from the transfer plan: per sender, what goes to which server ranks in which
round, and per server, the manifest it receives (``weights/shard_receive.py``). Pure, so every trainer rank
derives the same rounds without talking: a sender its own streams, rank 0 every server's manifest.

A stream is one sender's slices for a set of server ranks that need exactly the same slices from it (all
of them when servers take whole tensors), cut into buckets of at most ``bucket_bytes``; bucket ``k``
travels in round ``k``, as one message per slice to each of the stream's receivers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_areal.model.slices import HFSlice
from megatron_areal.weights.plan import TransferPlan

Item = tuple[str, HFSlice]  # (Megatron parameter it is cut from, the HF slice)


@dataclass(frozen=True)
class Stream:
    """One sender's buckets for ``receivers`` ((server, rank) pairs)."""

    sender: int
    receivers: tuple[tuple[int, int], ...]
    buckets: tuple[tuple[Item, ...], ...]


def slice_bytes(s: HFSlice, dtype: torch.dtype) -> int:
    return s.numel * dtype.itemsize


def cut_buckets(items: list[Item], bucket_bytes: int, dtype: torch.dtype) -> tuple[tuple[Item, ...], ...]:
    """Consecutive items in buckets of at most ``bucket_bytes`` (a larger slice travels alone)."""
    out: list[tuple[Item, ...]] = []
    current: list[Item] = []
    size = 0
    for item in items:
        n = slice_bytes(item[1], dtype)
        if current and size + n > bucket_bytes:
            out.append(tuple(current))
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        out.append(tuple(current))
    return tuple(out)


def streams_of(plan: TransferPlan, sender: int, *, bucket_bytes: int, dtype: torch.dtype) -> list[Stream]:
    """What ``sender`` sends, one stream per distinct set of slices its receivers need from it."""
    by_items: dict[tuple[Item, ...], list[tuple[int, int]]] = {}
    for receiver in plan.servers.receivers:
        items = tuple((t.source, t.slice) for t in plan.transfers_to(receiver) if t.sender == sender)
        if items:
            by_items.setdefault(items, []).append(receiver)
    return [Stream(sender, tuple(receivers), cut_buckets(list(items), bucket_bytes, dtype))
            for items, receivers in by_items.items()]


def all_streams(plan: TransferPlan, *, bucket_bytes: int, dtype: torch.dtype) -> list[Stream]:
    return [s for sender in plan.senders for s in streams_of(plan, sender, bucket_bytes=bucket_bytes, dtype=dtype)]


def manifest_for(streams: list[Stream], server: int, *, group_rank: dict[int, int], describe: dict[int, str],
                 dtype: torch.dtype) -> dict:
    """The manifest of ``server`` (its rank 0's view: every rank of a server must need the same slices)."""
    mine = [s for s in streams if (server, 0) in s.receivers]
    rounds = []
    for k in range(max((len(s.buckets) for s in mine), default=0)):
        # one message per slice, in the bucket's order: what ``shard_send`` sends
        rounds.append([{"src": group_rank[s.sender], "sender": describe[s.sender],
                        "slices": [[sl.name, str(dtype).removeprefix("torch."), list(sl.shape), sl.dim, sl.start,
                                    sl.stop]]}
                       for s in mine if k < len(s.buckets) for _, sl in s.buckets[k]])
    return {"rounds": rounds}
