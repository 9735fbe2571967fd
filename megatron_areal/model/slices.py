"""Which part of which HF tensor a tensor-parallel shard of a Megatron parameter holds.

Every TP shard of a Megatron parameter is, in the HF layout, one contiguous range of each of its HF
tensors along one dimension (``HFSlice``): a fused QKV shard holds whole query groups, so a range of
rows of ``q_proj``, ``k_proj`` and ``v_proj``; a fused gate/up shard a range of rows of each; a
row-parallel shard (``o_proj``, ``down_proj``) a range of columns; a vocabulary shard a range of rows
of the padded vocabulary, less the padding. Replicated parameters are whole. The rules (which HF
tensors, how they are fused, which dimension is split) are ``mapping``'s; this module only turns
them into ranges, so a trainer rank can send its own shard without gathering the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch


@dataclass(frozen=True)
class HFSlice:
    """Elements ``start:stop`` along ``dim`` of the HF tensor ``name`` of ``shape`` (all of it when whole)."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        rest = 1
        for i, n in enumerate(self.shape):
            rest *= n if i != self.dim else 1
        return rest * (self.stop - self.start)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.shape[self.dim]

    def narrow(self, start: int, stop: int) -> HFSlice:
        """The part of this slice inside ``start:stop`` (same dim); may be empty."""
        lo, hi = max(self.start, start), min(self.stop, stop)
        return HFSlice(self.name, self.shape, self.dim, lo, max(lo, hi))


def even_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s part of ``n`` items split evenly over ``size`` (the first ``n % size`` get one more)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_slices(arch: ModelArch, name: str, rank: int, size: int) -> list[HFSlice]:
    """The HF ranges TP rank ``rank`` of ``size`` holds of the global Megatron parameter ``name``
    (for experts pass the expert-TP rank and size); empty where a vocabulary shard is all padding."""
    hf = mapping.hf_names(arch, name)
    shapes = [tuple(mapping.hf_shape(arch, h)) for h in hf]
    dim = mapping.tp_dim(name)
    if dim is None or size == 1:  # whole, described along the dimension a TP server would split
        d = dim or 0
        return [HFSlice(h, s, d, 0, s[d]) for h, s in zip(hf, shapes, strict=True)]
    kind = mapping.rule_kind(name)
    if kind == "vocab":
        rows = arch.padded_vocab_size(size) // size
        start, stop = rank * rows, min((rank + 1) * rows, arch.vocab_size)
        return [HFSlice(hf[0], shapes[0], 0, start, stop)] if start < stop else []
    out = []
    for h, shape in zip(hf, shapes, strict=True):
        if shape[dim] % size:
            raise ValueError(f"{name}: {h} dimension {dim} of {shape} does not split into {size}")
        part = shape[dim] // size
        out.append(HFSlice(h, shape, dim, rank * part, (rank + 1) * part))
    return out


def shard_tensors(arch: ModelArch, name: str, shard: torch.Tensor, rank: int,
                  size: int) -> list[tuple[HFSlice, torch.Tensor]]:
    """``shard_slices`` with the values: views of this rank's ``shard`` of ``name`` in the HF layout."""
    slices = shard_slices(arch, name, rank, size)
    kind = mapping.rule_kind(name)
    if mapping.tp_dim(name) is None or size == 1:
        return [(s, t) for s, (_, t) in zip(slices, mapping.split(arch, name, shard), strict=True)]
    if kind == "vocab":
        return [(s, shard[: s.stop - s.start]) for s in slices]
    if kind == "glu":
        return list(zip(slices, torch.chunk(shard, 2, dim=0), strict=True))
    if kind == "qkv":
        groups, hd = arch.num_kv_heads // size, arch.head_dim
        q_per_group = arch.num_heads // arch.num_kv_heads * hd
        rest = shard.shape[1:]
        q, k, v = torch.split(shard.reshape(groups, q_per_group + 2 * hd, *rest), [q_per_group, hd, hd], dim=1)
        return list(zip(slices, (x.reshape(-1, *rest) for x in (q, k, v)), strict=True))
    return [(slices[0], shard)]
