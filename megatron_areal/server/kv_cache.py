"""Fixed-memory KV cache: ``num_slots`` sequences of up to ``max_len`` tokens each.

Memory is allocated once at start; a running sequence owns one slot from prefill to finish.
Slots waste memory on short sequences compared with pages, but keep attention a dense gather,
which is what a CPU wants.
"""
from __future__ import annotations

import torch

from megatron_areal.convert.arch import ModelArch


class KVCache:
    def __init__(self, arch: ModelArch, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (arch.num_layers, num_slots, max_len, arch.num_kv_heads, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
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

    def write_and_read(self, layer: int, slots: torch.Tensor, starts: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, T, KVH, D] at each row's positions; return keys/values [B, kv_len, KVH, D]."""
        t = k.shape[1]
        positions = starts[:, None] + torch.arange(t, device=k.device)[None, :]
        positions = positions.clamp_(max=self.max_len - 1)  # padded tail of a full-length row
        rows = slots[:, None].expand_as(positions)
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v
        return self.k[layer][slots, :kv_len], self.v[layer][slots, :kv_len]
