"""One trainer rank's side of a shard push: cut its slices from its own parameters, group them into
buckets and send each bucket point to point to the server ranks that need it, overlapped.

A bucket travels as one message per slice. A slice that is already contiguous in the push dtype (most
of a TP shard in the HF layout: row ranges, whole tensors) goes out as a view of the parameter,
copied by nobody but the transport; only the others (a cast, a strided view) are packed into a bucket
buffer. Bucket ``k + 1`` is converted and packed while bucket ``k`` is on the wire; at most ``in_flight``
buckets' buffers exist at once (the memory a push adds on this rank), so before packing another the
oldest must have left. Every wait is bounded by ``timeout_s``; a receiver that dies or stays
silent ends the push with its name.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.slices import HFSlice, shard_tensors
from megatron_areal.model.weights import named_global_params
from megatron_areal.weights.plan import TrainerLayout
from megatron_areal.weights.streams import Item, Stream, slice_bytes

log = logging.getLogger(__name__)


@dataclass
class SendStats:
    """What one rank sent: bytes on the wire (all receivers), buckets, the most buffer bytes held at once,
    and where the time went (packing, waiting for the wire)."""

    wire_bytes: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0
    pack_seconds: float = 0.0
    wait_seconds: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)  # receiver url -> what failed


class SliceSource:
    """This rank's parameters by global name, cut into HF slices on demand (one parameter cached)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, layout: TrainerLayout, rank: int) -> None:
        self.arch, self.layout, self.rank = arch, layout, rank
        self.params = {name: p for chunk in chunks for name, p in named_global_params(chunk)}
        self._cached: tuple[str, dict[str, tuple[HFSlice, torch.Tensor]]] | None = None
        self._storages = {p.untyped_storage().data_ptr() for p in self.params.values()}

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view of one of the parameters (sending it holds no memory of its own)."""
        return tensor.untyped_storage().data_ptr() in self._storages

    def values(self, source: str, want: HFSlice) -> torch.Tensor:
        """The elements of ``want`` (a slice of an HF tensor) from this rank's shard of ``source``."""
        if self._cached is None or self._cached[0] != source:
            if source not in self.params:
                raise KeyError(f"{self.layout.describe(self.rank)} holds no parameter {source!r} to send")
            expert = mapping.is_expert(source)
            shard, size = self.layout.shard_of(self.rank, expert) if mapping.tp_dim(source) is not None else (0, 1)
            local = self.params[source].detach()
            self._cached = (source, {s.name: (s, t) for s, t in shard_tensors(self.arch, source, local, shard, size)})
        have, tensor = self._cached[1][want.name]
        return tensor.narrow(want.dim, want.start - have.start, want.stop - want.start)


@torch.no_grad()
def send_streams(streams: list[Stream], source: SliceSource, *, group: dist.ProcessGroup,
                 receiver_rank: dict[tuple[int, int], int], receiver_name: dict[tuple[int, int], str],
                 dtype: torch.dtype, bucket_bytes: int, in_flight: int, timeout_s: float,
                 device: torch.device | None = None) -> SendStats:
    """Send every stream's buckets, round by round (tag = round), one message per slice in the bucket's
    order, with at most ``in_flight`` rounds' buffers held."""
    stats = SendStats()
    pending: collections.deque[_Round] = collections.deque()
    free: list[torch.Tensor] = []
    held = 0
    rounds = max((len(s.buckets) for s in streams), default=0)
    for k in range(rounds):
        while len(pending) >= in_flight and not stats.errors:
            held -= _retire(pending.popleft(), free, stats, receiver_name, timeout_s, bucket_bytes)
        if stats.errors:
            break
        clock = time.perf_counter()
        sent = _Round(k)
        for stream in streams:
            if k >= len(stream.buckets):
                continue
            messages, buffer, grown, copies = _messages(stream.buckets[k], source, free, dtype, bucket_bytes,
                                                        device)
            if buffer is not None:
                sent.buffers.append(buffer)
            sent.messages.extend(messages)  # the sends read them until the round is retired
            sent.copies += copies
            held += grown + copies
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, held)
            for receiver in stream.receivers:
                for message in messages:
                    sent.works.append((receiver, dist.isend(message, group=group,
                                                            group_dst=receiver_rank[receiver], tag=k)))
                    stats.wire_bytes += message.numel()
            stats.buckets += 1
        stats.pack_seconds += time.perf_counter() - clock
        pending.append(sent)
    while pending and not stats.errors:
        held -= _retire(pending.popleft(), free, stats, receiver_name, timeout_s, bucket_bytes)
    return stats


@dataclass
class _Round:
    """One round's sends in flight and the memory they read: bucket buffers (reused once the round is
    retired) and messages, some of them copies the HF conversion made (``copies`` bytes, freed then)."""

    k: int
    works: list[tuple[tuple[int, int], dist.Work]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    messages: list[torch.Tensor] = field(default_factory=list)
    copies: int = 0


def _messages(items: tuple[Item, ...], source: SliceSource, free: list[torch.Tensor], dtype: torch.dtype,
              bucket_bytes: int, device: torch.device | None
              ) -> tuple[list[torch.Tensor], torch.Tensor | None, int, int]:
    """One bucket's messages, one per slice as flat bytes: the slice itself where it is already contiguous in
    the push dtype (a view: nothing copied), else its values packed into a bucket buffer (a free one when
    there is one). Returns (the messages, the buffer or None, bytes newly allocated for it, bytes of the
    messages the HF conversion had to copy: held until the round is retired)."""
    values = [(s, source.values(name, s)) for name, s in items]
    direct = [t.dtype == dtype and t.is_contiguous() and (device is None or t.device == device) for _, t in values]
    packed = sum(slice_bytes(s, dtype) for (s, _), ok in zip(values, direct, strict=True) if not ok)
    buffer, grown = None, 0
    if packed:
        capacity = max(packed, bucket_bytes)
        reuse = next((i for i, b in enumerate(free) if b.numel() == capacity), None)
        if reuse is None:
            target = device if device is not None else values[0][1].device
            buffer = torch.empty(capacity, dtype=torch.uint8, device=target)
            grown = capacity
        else:
            buffer = free.pop(reuse)  # by position: ``list.remove`` would compare tensors elementwise
    messages, offset, copied = [], 0, {}
    for (s, t), ok in zip(values, direct, strict=True):
        if ok:
            if not source.owns(t):  # the whole copy lives while a slice of it is on the wire
                copied[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            messages.append(t.reshape(-1).view(torch.uint8))
            continue
        assert buffer is not None
        n = slice_bytes(s, dtype)
        shape = [s.stop - s.start if i == s.dim else d for i, d in enumerate(s.shape)]
        buffer[offset:offset + n].view(dtype).view(shape).copy_(t)
        messages.append(buffer[offset:offset + n])
        offset += n
    return messages, buffer, grown, sum(copied.values())


def _retire(sent: _Round, free: list[torch.Tensor], stats: SendStats, receiver_name: dict[tuple[int, int], str],
            timeout_s: float, bucket_bytes: int) -> int:
    """Wait for one round's sends (bounded); its buffers become free for the next rounds. Returns the bytes
    it held that are freed now (the conversion's copies, buffers too large to reuse)."""
    clock = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    for receiver, work in sent.works:
        try:
            work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except RuntimeError as e:
            name = receiver_name[receiver]
            stats.errors[name.split(" ")[0]] = f"{name}: bucket {sent.k} of the weight push not delivered: {e}"
    stats.wait_seconds += time.perf_counter() - clock
    freed = sent.copies
    if not stats.errors:  # kept for reuse; a larger one (a slice over the bucket size) is let go
        free.extend(b for b in sent.buffers if b.numel() == bucket_bytes)
        freed += sum(b.numel() for b in sent.buffers if b.numel() != bucket_bytes)
    return freed
