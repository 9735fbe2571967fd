"""Fixed-memory KV cache: ``num_slots`` sequences of up to ``max_len`` tokens each.

Memory is allocated once at start; a running sequence owns one slot from prefill to finish.
Slots waste memory on short sequences compared with pages, but each sequence's keys are one
strided view ``[kv_heads, length, head_dim]`` of its slot, so attention reads exactly the tokens a
sequence has, with no gather and no padding (see ``attention``).

Layout ``[layer, slot, kv_head, position, head_dim]``.
"""
from __future__ import annotations

import torch

from megatron_areal.model.arch import ModelArch


class KVCache:
    """Keys and values of ``num_slots`` sequences of up to ``max_len`` tokens, allocated once; a running
    request owns one slot."""

    def __init__(self, arch: ModelArch, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (arch.num_layers, num_slots, arch.num_kv_heads, max_len, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def bytes(self) -> int:
        """Memory of keys and values together."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (raises when none is left)."""
        if not self._free:
            raise RuntimeError("KV cache: no free slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Return a slot; a slot that is already free is an error (two sequences would share it)."""
        if slot in self._free:
            raise RuntimeError(f"KV cache: slot {slot} released twice")
        self._free.append(slot)

    def reset(self) -> None:
        """Every slot free again; only for when no sequence holds one."""
        self._free = list(range(self.num_slots - 1, -1, -1))

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N * kv_heads]``: where token i (at ``positions[i]`` of slot ``slots[i]``) keeps each kv
        head, as rows of a layer's cache flattened to ``[slots * kv_heads * max_len, head_dim]``."""
        kv_heads = self.k.shape[2]
        heads = torch.arange(kv_heads, device=slots.device)
        return ((slots[:, None] * kv_heads + heads) * self.max_len + positions[:, None]).reshape(-1)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ``[N, kv_heads, head_dim]`` at ``rows`` (``rows()``): one copy each, whatever N."""
        dim = self.k.shape[-1]
        self.k[layer].view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim))

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. length-1`` of a slot: views ``[kv_heads, length, head_dim]``."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]

    def window(self, layer: int, first: int, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. length-1`` of slots ``first .. first+count-1``: views
        ``[count, kv_heads, length, head_dim]``."""
        return (self.k[layer, first:first + count, :, :length], self.v[layer, first:first + count, :, :length])

    def gather(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions ``0 .. length-1`` of ``slots``:
        ``[len(slots), kv_heads, length, head_dim]``."""
        return (self.k[layer, :, :, :length].index_select(0, slots),
                self.v[layer, :, :, :length].index_select(0, slots))

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give slot ``dst`` the KV of the first ``length`` positions of slot ``src`` (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
