"""Attention of a packed batch against the slot KV cache, each sequence at its own length.

The rows of a forward (prefills, decodes, prompts that share a prefix) are packed one after the
other without padding. The decodes (one new token each, nearly every row of nearly every step)
attend in one call: SDPA over a window of consecutive slots, each slot's keys read in place as a
strided view of the cache up to the longest decode's length, shorter ones masked. One call per
layer instead of one per sequence: on the CPU every call is a parallel region whose threads meet
at a barrier, and with 32 sequences on a 2-core machine shared with other work the per-sequence
calls took 44 ms a layer against 5.4 ms for the one call (2 threads; 2.3 against 2.1 ms on one).
The masked keys cost arithmetic, not copies. A prefill (several tokens of one sequence) still
attends alone, causally, to exactly its own ``start + length`` keys.

Shapes: N packed tokens, H query heads, K kv heads, G = H / K, D head dim, W window slots, L keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from megatron_areal.server.kv_cache import KVCache

# Attending a sequence apart costs a copy of its keys and values and the attention itself; both
# against the extra keys it would make every slot of the window read.
APART_COST = 2
_UNPLANNED = object()


@dataclass
class Masked:
    """Keys ``0 .. keys-1`` of a set of slots, and ``mask_S11L``: 0 where a key is its sequence's,
    -inf past it."""

    keys: int
    mask_S11L: torch.Tensor


@dataclass
class DecodePlan:
    """Where a step's single-token rows sit in the packed batch and in the cache.

    ``tokens``: their packed positions (a slice when they lead the batch, as the engine packs them);
    ``lo``/``width``: the window of slots ``lo .. lo + width - 1`` holding them; ``window_rows``:
    each one's row in that window (None when they are the window, in order); ``window``: the keys
    the window reads. ``apart``: the few decodes much longer than the rest (their index among the
    decodes, their slots, their keys), attended apart so that the window reads only up to the
    longest of the others (None: none).
    """

    tokens: slice | torch.Tensor
    lo: int
    width: int
    window_rows: torch.Tensor | None
    window: Masked
    apart: tuple[torch.Tensor, torch.Tensor, Masked] | None


class ForwardBatch:
    """The rows of one forward, packed into one sequence of N tokens: row r feeds ``lengths[r]``
    tokens to KV slot ``slots[r]``, at positions ``starts[r]`` on (keys before ``starts[r]`` are
    in the slot already)."""

    def __init__(self, slots: list[int], starts: list[int], lengths: list[int], device: torch.device) -> None:
        assert min(lengths) >= 1, "a row feeds at least one token"
        firsts = list(accumulate(lengths[:-1], initial=0))
        self.rows = list(zip(slots, starts, lengths, firsts, strict=True))  # (slot, start, length, first)
        self.device = device
        self.starts = torch.tensor(starts, dtype=torch.long, device=device)
        self.first = torch.tensor(firsts, dtype=torch.long, device=device)  # index of each row's first token
        self.last = self.first + torch.tensor(lengths, dtype=torch.long, device=device) - 1
        self.token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], device=device)
        self.token_positions = torch.tensor([p for s, n in zip(starts, lengths) for p in range(s, s + n)],
                                            device=device)
        self.positions = self.token_positions[None]  # [1, N]: the packed row's positions, for RoPE
        self.prefills = [row for row in self.rows if row[2] > 1]
        self._cache_rows: torch.Tensor | None = None
        self._decode: DecodePlan | None | object = _UNPLANNED

    def cache_rows(self, cache: KVCache) -> torch.Tensor:
        """Each token's rows in a layer's flattened cache (``KVCache.rows``), computed once a step."""
        if self._cache_rows is None:
            self._cache_rows = cache.rows(self.token_slots, self.token_positions)
        return self._cache_rows

    def decode(self, cache: KVCache) -> DecodePlan | None:
        """The single-token rows' plan (None when there are none), computed once a step."""
        if self._decode is _UNPLANNED:
            self._decode = _plan_decodes([r for r in self.rows if r[2] == 1], cache, self.device)
        return self._decode


def _plan_decodes(rows: list[tuple[int, int, int, int]], cache: KVCache, device: torch.device) -> DecodePlan | None:
    if not rows:
        return None
    slots = [slot for slot, _, _, _ in rows]
    firsts = [first for _, _, _, first in rows]
    keys = [start + 1 for _, start, _, _ in rows]
    lo, width = min(slots), max(slots) - min(slots) + 1
    apart = _apart(keys, width)
    in_order = width == len(rows) and all(s == lo + i for i, s in enumerate(slots))
    tokens = (slice(firsts[0], firsts[0] + len(rows)) if firsts == list(range(firsts[0], firsts[0] + len(rows)))
              else torch.tensor(firsts, dtype=torch.long, device=device))
    window_keys = [1] * width  # a slot in the window that is not decoding here reads its first key (discarded)
    for i, (slot, n) in enumerate(zip(slots, keys, strict=True)):
        if i not in apart:
            window_keys[slot - lo] = n
    window_rows = None if in_order else torch.tensor([s - lo for s in slots], dtype=torch.long, device=device)
    plan = DecodePlan(tokens, lo, width, window_rows, _masked(window_keys, cache.k.dtype, device), None)
    if apart:
        plan.apart = (torch.tensor(apart, dtype=torch.long, device=device),
                      torch.tensor([slots[i] for i in apart], dtype=torch.long, device=device),
                      _masked([keys[i] for i in apart], cache.k.dtype, device))
    return plan


def _apart(keys: list[int], width: int) -> list[int]:
    """Which decodes to attend apart: the longest g, for the g that makes the least work, counting a
    key read by the window as 1 and a key of a decode apart as ``APART_COST``."""
    order = sorted(range(len(keys)), key=lambda i: -keys[i])
    longest = keys[order[0]]
    best, cost = 0, width * longest
    for g in range(1, len(keys) // 4 + 1):
        c = width * keys[order[g]] + APART_COST * g * longest
        if c < cost:
            best, cost = g, c
    return sorted(order[:best])


def _masked(lengths: list[int], dtype: torch.dtype, device: torch.device) -> Masked:
    keys = max(lengths)
    visible = torch.arange(keys, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    mask = torch.zeros(len(lengths), 1, 1, keys, dtype=dtype, device=device).masked_fill_(
        ~visible[:, None, None, :], float("-inf"))
    return Masked(keys, mask)


def packed_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cache: KVCache,
                     layer: int, batch: ForwardBatch) -> torch.Tensor:
    """Write the new keys/values into the cache, then attend: the decodes together, each prefill alone;
    returns ``[N, H, D]``."""
    cache.write_rows(layer, batch.cache_rows(cache), k_NKD, v_NKD)
    plan = batch.decode(cache)
    decoded = None if plan is None else _decode_attention(q_NHD[plan.tokens], cache, layer, plan)
    if not batch.prefills:
        return decoded
    out = torch.empty_like(q_NHD)
    if decoded is not None:
        out[plan.tokens] = decoded
    for slot, start, n, first in batch.prefills:
        keys_1KLD, values_1KLD = (t[None] for t in cache.read(layer, slot, start + n))  # 4-D: SDPA's fast kernel
        q_1HnD = q_NHD[first:first + n].transpose(0, 1)[None]
        attended = F.scaled_dot_product_attention(q_1HnD, keys_1KLD, values_1KLD,
                                                  attn_mask=_causal(start, n, q_NHD.device),
                                                  is_causal=start == 0, enable_gqa=True)
        out[first:first + n] = attended[0].transpose(0, 1)
    return out


def _decode_attention(q_nHD: torch.Tensor, cache: KVCache, layer: int, plan: DecodePlan) -> torch.Tensor:
    """One query token per decoding slot against its keys; the query heads that share a kv head are
    that kv head's query rows (no GQA copies)."""
    n, heads, dim = q_nHD.shape
    kv_heads = cache.k.shape[2]
    if plan.window_rows is None:
        q_WHD = q_nHD
    else:
        q_WHD = q_nHD.new_zeros(plan.width, heads, dim).index_copy_(0, plan.window_rows, q_nHD)
    keys_WKLD, values_WKLD = cache.window(layer, plan.lo, plan.width, plan.window.keys)
    out = F.scaled_dot_product_attention(q_WHD.view(plan.width, kv_heads, heads // kv_heads, dim),
                                         keys_WKLD, values_WKLD, attn_mask=plan.window.mask_S11L)
    out_WHD = out.reshape(plan.width, heads, dim)
    out_nHD = out_WHD if plan.window_rows is None else out_WHD.index_select(0, plan.window_rows)
    if plan.apart is not None:
        rows, slots, masked = plan.apart
        keys_gKLD, values_gKLD = cache.gather(layer, slots, masked.keys)
        q_gKGD = q_nHD.index_select(0, rows).view(len(rows), kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(q_gKGD, keys_gKLD, values_gKLD, attn_mask=masked.mask_S11L)
        out_nHD.index_copy_(0, rows, out.reshape(len(rows), heads, dim))
    return out_nHD


def _causal(start: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at position start + i) sees keys 0 .. start + i; None for a row from position 0,
    which is SDPA's own ``is_causal``."""
    if start == 0:
        return None
    return torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
