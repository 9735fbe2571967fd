"""The packed (thd) attention of the actor against one plain causal attention call per sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_areal.actor.attention import PackedCoreAttention, padded_buckets
from megatron_areal.actor.microbatch import SharedPrefixParams


def attention(heads: int = 6, groups: int = 2, dim: int = 8) -> PackedCoreAttention:
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=dim, attention_dropout=0.0, use_cpu_initialization=True)
    return PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self")


def per_sequence(q, k, v, lengths, scale):
    """Reference: torch's causal attention, one call per sequence, in float64."""
    outs, start = [], 0
    for n in filter(None, lengths):
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=True).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [(5, 3, 7, 1, 9), (120, 4, 0, 33, 2, 2, 61), (17,), tuple(range(1, 40, 3))])
def test_packed_attention_matches_one_call_per_sequence(lengths):
    torch.manual_seed(sum(lengths))
    module = attention()
    total = sum(lengths)
    q = torch.randn(total, 6, 8, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    out = module(q, k, v, None, packed_seq_params=params)
    ref = per_sequence(q, k, v, lengths, module.softmax_scale)
    assert out.shape == (total, 48)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(total, 48, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_buckets_bound_padding_and_cover_every_token_once():
    lengths = (400, 7, 9, 300, 12, 0, 11, 250, 8)
    buckets, order = padded_buckets(lengths)
    assert sorted(order.tolist()) == list(range(sum(lengths)))
    for gather, keep, rows, width in buckets:
        assert gather.numel() == rows * width and keep.numel() <= rows * width
    padded = sum(rows * width ** 2 for _, _, rows, width in buckets)
    assert padded <= 2.0 * sum(n ** 2 for n in lengths)
    assert len(buckets) < len([n for n in lengths if n])  # short sequences share a call


def test_branches_attend_to_their_shared_tokens_then_themselves():
    """Segments continuing a shared segment (actor/shared_prefix.py) equal each branch attended
    whole: shared tokens then its own, one causal call per expanded sequence."""
    torch.manual_seed(7)
    module = attention()
    lengths, continues = (6, 3, 1, 5, 4, 2), (-1, 0, 0, 0, -1, 4)
    total = sum(lengths)
    q = torch.randn(total, 6, 8, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    params = SharedPrefixParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11,
                                max_seqlen_kv=11, continues=continues)
    out = module(q, k, v, None, packed_seq_params=params)
    starts = cu.tolist()
    ref = torch.empty(total, 48, dtype=torch.float64)
    for i, c in enumerate(continues):
        rows = list(range(starts[c], starts[c + 1])) if c >= 0 else []
        own = list(range(starts[i], starts[i + 1]))
        full = per_sequence(q[rows + own], k[rows + own], v[rows + own], [len(rows) + len(own)], module.softmax_scale)
        ref[own] = full[len(rows):]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(total, 48, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):  # the shared tokens' k and v gather gradients from every branch
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
