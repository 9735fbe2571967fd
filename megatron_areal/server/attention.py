"""Attention of a packed batch against the slot KV cache, each sequence at its own length.

The rows of a forward (prefills, decodes, prompts that share a prefix) are packed one after the
other without padding. Each row attends to exactly its own ``start + length`` keys, read as a view
of its slot: a decode step costs what the sequences' real lengths cost, not ``batch x longest``.
One small attention call per row is cheaper on a CPU than gathering the rows into a padded batch
and masking it, which copies every row up to the longest.

Shapes: N packed tokens, H query heads, K kv heads, D head dim.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from megatron_areal.server.kv_cache import KVCache


class ForwardBatch:
    """The rows of one forward, packed into one sequence of N tokens: row r feeds ``lengths[r]``
    tokens to KV slot ``slots[r]``, at positions ``starts[r]`` on (keys before ``starts[r]`` are
    in the slot already)."""

    def __init__(self, slots: list[int], starts: list[int], lengths: list[int], device: torch.device) -> None:
        assert min(lengths) >= 1, "a row feeds at least one token"
        firsts = list(accumulate(lengths[:-1], initial=0))
        self.rows = list(zip(slots, starts, lengths, firsts, strict=True))  # (slot, start, length, first)
        self.starts = torch.tensor(starts, dtype=torch.long, device=device)
        self.first = torch.tensor(firsts, dtype=torch.long, device=device)  # index of each row's first token
        self.last = self.first + torch.tensor(lengths, dtype=torch.long, device=device) - 1
        self.token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], device=device)
        self.token_positions = torch.tensor([p for s, n in zip(starts, lengths) for p in range(s, s + n)],
                                            device=device)
        self.positions = self.token_positions[None]  # [1, N]: the packed row's positions, for RoPE


def packed_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cache: KVCache,
                     layer: int, batch: ForwardBatch) -> torch.Tensor:
    """Write the new keys/values into the cache, then attend row by row; returns ``[N, H, D]``."""
    cache.write(layer, batch.token_slots, batch.token_positions, k_NKD, v_NKD)
    outs = []
    kv_heads = k_NKD.shape[1]
    for slot, start, n, first in batch.rows:
        keys_1KLD, values_1KLD = (t[None] for t in cache.read(layer, slot, start + n))  # 4-D: SDPA's fast kernel
        q_nHD = q_NHD[first:first + n]
        if n == 1:  # a decode: the query heads that share a kv head are its rows (no GQA copies, no mask)
            out = F.scaled_dot_product_attention(q_nHD.view(1, kv_heads, -1, q_nHD.shape[-1]), keys_1KLD, values_1KLD)
            outs.append(out.view(q_nHD.shape))
        else:
            out = F.scaled_dot_product_attention(q_nHD.transpose(0, 1)[None], keys_1KLD, values_1KLD,
                                                 attn_mask=_causal(start, n, q_NHD.device),
                                                 is_causal=start == 0, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _causal(start: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at position start + i) sees keys 0 .. start + i; None for a row from position 0,
    which is SDPA's own ``is_causal``."""
    if start == 0:
        return None
    return torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
