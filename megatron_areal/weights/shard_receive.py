"""The receiving side of a shard push: slices of HF tensors from several trainer ranks, point to point.

In a shard push every sending trainer rank and every server rank are members of one group (senders
first). A server is told, in one request, what arrives: a manifest of rounds; in round k each sender
with something for it sends its slices as messages (tag k), each slice contiguous in the slice's own
shape (the HF tensor's shape with ``dim`` cut to ``start:stop``). The receiver assembles the slices into
whole HF tensors and hands each one over as soon as all its elements came.

    manifest = {"rounds": [[{"src": group rank, "sender": "trainer rank 3 (pp1 tp1 dp0)",
                             "slices": [[hf_name, dtype, full_shape, dim, start, stop], ...]}, ...], ...]}

The receiver writes into memory it already holds where it can (``Spares``): a CPU receive into fresh
pages pays for the kernel's page faults and zeroing, which on a 2-core EPYC made a 96 MiB receive take 80 ms
against 13 ms into memory touched before (one thread).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


class WireError(RuntimeError):
    """A shard push that could not complete; the message names the party that failed."""


def slice_shape(shape: list[int], dim: int, start: int, stop: int) -> list[int]:
    """The shape of elements ``start:stop`` along ``dim`` of a tensor of ``shape``."""
    return [stop - start if i == dim else n for i, n in enumerate(shape)]


def slice_spec(spec: object) -> tuple[str, torch.dtype, list[int], int, int, int]:
    """One manifest slice checked: (name, dtype, full shape, dim, start, stop); ``ValueError`` names what is wrong."""
    if not isinstance(spec, (list, tuple)) or len(spec) != 6:
        raise ValueError(f"slice {spec!r} is not [name, dtype, shape, dim, start, stop]")
    name, dtype_name, shape, dim, start, stop = spec
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
        raise ValueError(f"slice {str(spec)[:200]}: bad name or dtype")
    if not dtype.is_floating_point:  # weights are floats; an integer or bool tensor would truncate them
        raise ValueError(f"slice of {name[:200]}: dtype {dtype_name} is not a floating-point dtype")
    if not isinstance(shape, list) or not shape or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"slice of {name}: shape {shape!r} is not a list of sizes")
    if not all(isinstance(v, int) for v in (dim, start, stop)) or not 0 <= dim < len(shape) \
            or not 0 <= start < stop <= shape[dim]:
        raise ValueError(f"slice of {name}: {dim=} {start=} {stop=} outside shape {shape}")
    return name, dtype, shape, dim, start, stop


def slice_nbytes(shape: list[int], dim: int, start: int, stop: int, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for size in slice_shape(shape, dim, start, stop):
        n *= size
    return n


def check_manifest(manifest: object, *, senders: int, max_bytes: int) -> list[list[tuple[int, str, list]]]:
    """The manifest's rounds as [(src, sender, [slice spec, ...]), ...]; ``ValueError`` for anything that
    cannot describe a receive (before any is posted): a source outside the ``senders`` group ranks, a
    slice out of range, a tensor described two ways, more than ``max_bytes`` in all."""
    rounds = manifest.get("rounds") if isinstance(manifest, dict) else None
    if not isinstance(rounds, list):
        raise ValueError("manifest.rounds must be a list of rounds")
    out, shapes, total = [], {}, 0
    for k, messages in enumerate(rounds):
        if not isinstance(messages, list):
            raise ValueError(f"manifest round {k} must be a list of messages")
        checked = []
        for m in messages:
            src = m.get("src") if isinstance(m, dict) else None
            if not isinstance(src, int) or not 0 <= src < senders or not isinstance(m.get("slices"), list):
                raise ValueError(f"manifest round {k}: message {str(m)[:200]} needs src in 0..{senders - 1} "
                                 "and a list of slices")
            specs = [slice_spec(s) for s in m["slices"]]
            for name, dtype, shape, dim, start, stop in specs:
                if shapes.setdefault(name, (dtype, shape)) != (dtype, shape):
                    raise ValueError(f"manifest: {name} is described as {shapes[name]} and as {(dtype, shape)}")
                total += slice_nbytes(shape, dim, start, stop, dtype)
            checked.append((src, str(m.get("sender", f"group rank {src}")), specs))
        out.append(checked)
    if total > max_bytes:
        raise ValueError(f"manifest: {total} bytes in all exceed this server's limit of {max_bytes}")
    return out


def receive_slices(pg: dist.ProcessGroup, rounds: list[list[tuple[int, str, list]]], *, timeout_s: float,
                   device: torch.device, on_complete: Callable[[dict[str, torch.Tensor]], None],
                   spares: Spares | None = None) -> int:
    """Receive every round of a checked manifest (``check_manifest``) and assemble whole tensors.

    As soon as a message completes tensors, ``on_complete({name: tensor})`` gets them (fresh tensors, no one
    else's): installed while their bytes are still in the CPU's cache, and while the next messages are on the
    wire, not all at the end. Round k + 1's receives are posted before round k is waited for, so at most two
    rounds' tensors are held. Every wait is bounded by ``timeout_s``; a sender that fails or stays silent
    raises ``WireError`` naming it. Tensors and buffers come from ``spares`` where it has them (the buffers go
    back to it). Returns the number of tensors assembled.
    """
    spares = spares if spares is not None else Spares(0)
    assembly = _Assembly(device, spares)
    done = 0
    posted = _post(pg, rounds[0], 0, assembly) if rounds else []
    for k in range(len(rounds)):
        ahead = _post(pg, rounds[k + 1], k + 1, assembly) if k + 1 < len(rounds) else []
        for sender, work, finish in posted:
            try:
                work.wait(timedelta(seconds=timeout_s))
            except RuntimeError as e:
                raise WireError(f"{sender}: round {k} of the weight push not received: {e}") from None
            complete = {name: assembly.take(name) for name in finish()}
            done += len(complete)
            if complete:
                on_complete(complete)
        posted = ahead
    if assembly.missing:
        missing = ", ".join(f"{n} ({m} elements)" for n, m in list(assembly.missing.items())[:5])
        raise WireError(f"weight push ended with tensors incomplete: {missing}")
    return done


class _Assembly:
    """Whole tensors being assembled from slices: each allocated when its first slice is posted."""

    def __init__(self, device: torch.device, spares: Spares) -> None:
        self.device, self.spares = device, spares
        self.tensors: dict[str, torch.Tensor] = {}
        self.missing: dict[str, int] = {}  # elements not yet received

    def region(self, name: str, dtype: torch.dtype, shape: list[int], dim: int, a: int, b: int) -> torch.Tensor:
        """The part ``a:b`` along ``dim`` of the tensor ``name`` (allocated with its first part)."""
        if name not in self.tensors:
            self.tensors[name] = self.spares.take(shape, dtype, self.device)
            self.missing[name] = _numel(shape)
        return self.tensors[name].narrow(dim, a, b - a)

    def arrived(self, name: str, region: torch.Tensor) -> bool:
        """Count ``region`` of ``name`` as received; whether the tensor is complete now."""
        self.missing[name] -= region.numel()
        return self.missing[name] <= 0

    def take(self, name: str) -> torch.Tensor:
        self.missing.pop(name)
        return self.tensors.pop(name)


def _post(pg: dist.ProcessGroup, messages: list[tuple[int, str, list]], k: int,
          assembly: _Assembly) -> list[tuple[str, dist.Work, object]]:
    """Post one round's receives, in the manifest's order. A message of one slice that is a contiguous range
    of its tensor lands in the tensor itself; any other is received into a buffer and copied out after.
    Returns (sender, work, finish) per message: ``finish()`` completes the copies and names the tensors
    this message completed."""
    posted = []
    for src, sender, specs in messages:
        regions = [(assembly.region(name, dtype, shape, dim, a, b), name) for name, dtype, shape, dim, a, b in specs]
        if len(regions) == 1 and regions[0][0].is_contiguous():
            region, name = regions[0]
            work = dist.irecv(region.reshape(-1).view(torch.uint8), group=pg, group_src=src, tag=k)
            posted.append((sender, work, lambda name=name, region=region: [name] if assembly.arrived(name, region)
                           else []))
            continue
        size = sum(r.numel() * r.element_size() for r, _ in regions)
        buffer = assembly.spares.take([size], torch.uint8, assembly.device)

        def finish(buffer: torch.Tensor = buffer, regions: list = regions) -> list[str]:
            offset, names = 0, []
            for region, name in regions:
                n = region.numel() * region.element_size()
                piece = buffer[offset:offset + n]
                piece = piece if offset % region.element_size() == 0 else piece.clone()
                region.copy_(piece.view(region.dtype).view(region.shape))
                offset += n
                if assembly.arrived(name, region):
                    names.append(name)
            del piece  # the last view of the buffer: given back, it must be the buffer's only tensor
            assembly.spares.give(buffer)
            return names

        posted.append((sender, dist.irecv(buffer, group=pg, group_src=src, tag=k), finish))
    return posted


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


class Spares:
    """Tensors a receiver may write the next push into: the weights a push replaced (handed back by the
    server once nothing else references them) and the receive buffers of slices that land elsewhere.

    ``take`` returns a spare of the shape and dtype asked for, or a new tensor; ``give`` keeps a tensor only
    when no other tensor shares its memory (a view, a kept adapter base, the served weights) and the pool
    stays within ``limit_bytes``. One pool per receiver, used by one push at a time.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held = 0
        self._free: defaultdict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype, device))
        if free:
            t = free.pop()
            self.held -= t.nbytes
            return t
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> bool:
        """Keep ``t`` for a later ``take``; whether it was kept."""
        storage = t.untyped_storage()
        # references to the memory: ``t`` and ``storage`` here; any more is someone else's tensor on it
        alone = torch._C._storage_Use_Count(storage._cdata) == 2 and storage.nbytes() == t.nbytes
        if not alone or not t.is_contiguous() or self.held + t.nbytes > self.limit_bytes:
            return False
        self._free[(tuple(t.shape), t.dtype, t.device)].append(t.detach())
        self.held += t.nbytes
        return True
