"""Core attention for the local (non-TE) layer spec that understands packed sequences.

Megatron's ``DotProductAttention`` refuses ``PackedSeqParams``. This module takes the same
arguments and supports both layouts:

- ``sbhd`` (ordinary batches): causal attention over each row; right padding is harmless because
  a causal mask never lets a real token see a later pad token.
- ``thd`` (packed): each sequence of the 1-D micro-batch (bounded by ``cu_seqlens_q``) attends
  causally to itself only, or, where it continues a segment of shared prompt tokens
  (``SharedPrefixParams.continues``, actor/shared_prefix.py), to those tokens and then itself.
  Sequences of similar length are gathered into right-padded buckets ``[n, heads, width, dim]``
  (a continuing sequence's row holds the shared tokens first) and each bucket is one attention
  call: a call per sequence cost more in fixed overhead than in arithmetic (RL sequences are
  short; 48 x 30 calls a step took a fifth of a SmolLM2 step on CPU), while one block-diagonal
  mask over the pack would cost T^2. A bucket grows while its padded area stays within
  ``_PAD_SLACK`` x the sum of its rows' L^2, so the cost stays near sum(L_i^2) for long-tailed
  lengths too.

Rotary positions restart at 0 per sequence and a branch's continue from its shared tokens; they
are applied before this module (megatron_areal/patches/packed_rope.py), with ``max_seqlen_q`` as the table length.
Shapes: q ``[s, b, np, hn]`` / ``[t, np, hn]``; k, v with ``ng`` query groups (GQA).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_PAD_SLACK = 2.0  # a bucket's width^2 x rows may be at most this times the sum of its L^2


@functools.lru_cache(maxsize=16)
def padded_buckets(lengths: tuple[int, ...], continues: tuple[int, ...] = ()
                   ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, int, int]], torch.Tensor]:
    """Buckets of right-padded rows for the packed segments of ``lengths`` (in pack order).

    Each segment is one row: its own tokens, after those of the segment it continues
    (``continues[k] >= 0``: a branch after its shared tokens, actor/shared_prefix.py), so causal
    attention over the row lets it see both. Returns ``(buckets, order)``: each bucket is
    ``(gather, keep, rows, width)`` where ``gather`` [rows * width] indexes the pack (a padding
    slot repeats its row's last token: causal attention never lets a real token see it, and its
    output is dropped) and ``keep`` picks each row's own tokens out of the flattened padded rows;
    ``order`` puts the buckets' concatenated outputs back in pack order. Cached: every layer of a
    micro-batch asks for the same segments.
    """
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    before = [lengths[c] if c >= 0 else 0 for c in continues] + [0] * (len(lengths) - len(continues))
    width_of = [before[i] + lengths[i] for i in range(len(lengths))]
    by_width = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -width_of[i])
    groups: list[list[int]] = []
    for i in by_width:  # widest first, so a bucket's first row sets its width
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * width_of[g[0]] ** 2 <= _PAD_SLACK * sum(width_of[j] ** 2 for j in g + [i]):
            g.append(i)
        else:
            groups.append([i])
    buckets, position, offset = [], [0] * starts[-1], 0
    for g in groups:
        width = width_of[g[0]]
        gather, keep = [], []
        for r, i in enumerate(g):
            row = [starts[continues[i]] + j for j in range(before[i])] + list(range(starts[i], starts[i + 1]))
            gather += row + [row[-1]] * (width - len(row))
            keep += [r * width + before[i] + j for j in range(lengths[i])]
            position[starts[i]:starts[i + 1]] = range(offset, offset + lengths[i])
            offset += lengths[i]
        buckets.append((torch.tensor(gather), torch.tensor(keep), len(g), width))
    return buckets, torch.tensor(position)


class PackedCoreAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention: context parallelism needs the Transformer Engine spec")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"PackedCoreAttention: only causal self-attention, got {attn_mask_type}")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn], causal."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1),
            dropout_p=self.dropout if self.training else 0.0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention: attention_bias is not supported")
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            # [s, b, h, d] -> [b, h, s, d]; the causal mask replaces Megatron's attention_mask
            out = self._attend(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))
            s, b = query.size(0), query.size(1)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        if cu[-1] != query.size(0):
            raise ValueError(f"PackedCoreAttention: cu_seqlens ends at {cu[-1]} but the pack has "
                             f"{query.size(0)} tokens")
        buckets, order = padded_buckets(tuple(end - start for start, end in zip(cu[:-1], cu[1:])),
                                        tuple(getattr(packed_seq_params, "continues", ())))
        outs, device = [], query.device  # the (cached) index tensors are built on the CPU
        for gather, keep, rows, width in buckets:
            gather, keep = gather.to(device, non_blocking=True), keep.to(device, non_blocking=True)
            q, k, v = (x.index_select(0, gather).view(rows, width, *x.shape[1:]).transpose(1, 2)
                       for x in (query, key, value))
            out = self._attend(q, k, v).transpose(1, 2).reshape(rows * width, *query.shape[1:])
            outs.append(out.index_select(0, keep))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.index_select(0, order.to(device, non_blocking=True)).reshape(query.size(0), -1)
