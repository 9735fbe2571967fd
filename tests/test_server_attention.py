"""The embedded server's packed attention against one plain causal attention call per sequence."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_areal.server.attention import ForwardBatch, packed_attention
from megatron_areal.server.kv_cache import KVCache

HEADS, KV_HEADS, DIM, SLOTS, MAX_LEN = 6, 2, 16, 12, 512


def per_sequence(q_NHD, cache: KVCache, layer: int, rows) -> torch.Tensor:
    """Reference: each row's queries against its slot's keys 0 .. start + length - 1, causal, in float64."""
    outs = []
    for slot, start, n, first in rows:
        keys = cache.k[layer, slot, :, :start + n].double()
        values = cache.v[layer, slot, :, :start + n].double()
        q = q_NHD[first:first + n].double().transpose(0, 1)
        mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        outs.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


# (slot, tokens already cached, tokens fed): decodes feed 1, prefills more
STEPS = {
    "decodes in slot order": [(0, 40, 1), (1, 3, 1), (2, 17, 1), (3, 60, 1)],
    "decodes out of order, gaps in the window": [(7, 5, 1), (2, 90, 1), (4, 0, 1), (9, 33, 1)],
    "one decode far longer than the rest": [(s, 6 + s, 1) for s in range(10)] + [(10, 400, 1), (11, 380, 1)],
    "decodes and prefills together": [(5, 30, 1), (0, 0, 9), (3, 12, 1), (8, 20, 4), (1, 300, 1)],
    "prefills only": [(2, 0, 7), (6, 11, 3)],
}


@pytest.mark.parametrize("name", list(STEPS))
def test_packed_attention_matches_one_call_per_sequence(name: str) -> None:
    torch.manual_seed(len(name))
    arch = SimpleNamespace(num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM)
    cache = KVCache(arch, SLOTS, MAX_LEN, torch.float32, torch.device("cpu"))
    cache.k.normal_(), cache.v.normal_()  # the keys already in the slots; positions past them are noise
    slots, starts, lengths = zip(*STEPS[name], strict=True)
    batch = ForwardBatch(list(slots), list(starts), list(lengths), torch.device("cpu"))
    total = sum(lengths)
    q, k, v = torch.randn(total, HEADS, DIM), torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    out = packed_attention(q, k, v, cache, 1, batch)
    for slot, start, n, first in batch.rows:  # the new keys and values are in the cache, at their positions
        assert torch.equal(cache.k[1, slot, :, start:start + n], k[first:first + n].transpose(0, 1))
        assert torch.equal(cache.v[1, slot, :, start:start + n], v[first:first + n].transpose(0, 1))
    torch.testing.assert_close(out.double(), per_sequence(q, cache, 1, batch.rows), atol=1e-5, rtol=1e-5)
