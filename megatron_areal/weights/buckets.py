"""This pipeline stage's weights in the inference layout (HF names and shapes), in buckets.

The per-architecture mapping is the conversion's; ``gather.stage_hf_tensors`` gathers one Megatron
parameter at a time to the stage head and splits it into HF tensors. Every rank that holds a
piece (TP peers, expert-parallel ranks) must run the generator to the end, because the gathers
are collective; only the stage head receives, so it alone holds a bucket (plus the parameter
being converted) and the other ranks hold nothing extra.

Flat buckets (SGLang's ``load_format="flattened_bucket"``) pack the tensors' bytes back to back
into one reused buffer of the bucket size and travel as a single broadcast; otherwise each tensor
is its own broadcast, in ``names`` order.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.model.arch import ModelArch
from megatron_areal.weights.gather import stage_adapter_tensors, stage_hf_tensors, stage_lora_scale


@dataclass
class Bucket:
    """HF-named tensors announced together in one ``/update_weights_from_distributed`` call."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    payload: list[torch.Tensor] = field(default_factory=list)  # what is broadcast, in order
    nbytes: int = 0
    flat: bool = False
    lora_scale: float | None = None  # set when the bucket holds adapters (``wire.AdapterMerge``)

    def describe(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.dtypes.append(str(tensor.dtype).removeprefix("torch."))
        self.shapes.append(list(tensor.shape))
        self.nbytes += tensor.numel() * tensor.element_size()

    def __len__(self) -> int:
        return len(self.names)

    def meta(self) -> dict[str, list]:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": list(self.shapes)}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def hf_buckets(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *, bucket_bytes: int,
               flat: bool = True, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of at most ``bucket_bytes`` (see ``pack_buckets``).

    On the stage head only; the ranks that help with the gathers (TP peers, expert ranks) run it to
    the end and get nothing.
    """
    tensors = stage_hf_tensors(chunks, arch, groups, dtype=dtype)
    if device is not None:
        tensors = ((name, tensor.to(device)) for name, tensor in tensors)
    return pack_buckets(tensors, bucket_bytes=bucket_bytes, flat=flat)


def adapter_buckets(chunks: Sequence[torch.nn.Module], groups: ParallelGroups, *, bucket_bytes: int,
                    flat: bool = True, device: torch.device | None = None) -> Iterator[Bucket]:
    """This stage's adapters (``A`` and ``B`` only, PEFT-named) in buckets, each marked with the adapters'
    scale; on the stage head only, the other ranks of data-parallel replica 0 take part in the gathers."""
    scale = stage_lora_scale(chunks)
    tensors = stage_adapter_tensors(chunks, groups)
    if device is not None:
        tensors = ((name, tensor.to(device)) for name, tensor in tensors)
    for bucket in pack_buckets(tensors, bucket_bytes=bucket_bytes, flat=flat):
        bucket.lora_scale = scale
        yield bucket


def pack_buckets(tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                 flat: bool = True) -> Iterator[Bucket]:
    """Buckets of at most ``bucket_bytes`` (a single larger tensor travels alone), in order.

    Each bucket is valid until the next one is requested (flat buckets share one buffer). A flat
    bucket is the receiver's layout: tensors back to back without padding, each at an offset
    that is a multiple of its element size (SGLang refuses anything else), so a tensor that
    would land unaligned after one of a smaller dtype starts a new bucket.
    """
    bucket = Bucket(flat=flat)
    buffer: torch.Tensor | None = None
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (bucket.nbytes + nbytes > bucket_bytes or (flat and bucket.nbytes % tensor.element_size())):
            yield _seal(bucket, buffer)
            bucket = Bucket(flat=flat)
        if not flat:
            # q/k/v and gate/up are views of the gathered parameter; a contiguous copy lets it go
            bucket.payload.append(tensor.contiguous())
        elif nbytes > bucket_bytes:
            bucket.payload.append(_as_bytes(tensor))  # alone in its bucket: no copy into the buffer
        else:
            if buffer is None:
                buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=tensor.device)
            buffer[bucket.nbytes:bucket.nbytes + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        bucket.describe(name, tensor)
    if bucket:
        yield _seal(bucket, buffer)


def _seal(bucket: Bucket, buffer: torch.Tensor | None) -> Bucket:
    if bucket.flat and not bucket.payload:
        assert buffer is not None
        bucket.payload = [buffer[:bucket.nbytes]]
    return bucket
