"""Core attention for the local (non-TE) layer spec that understands packed sequences.

Megatron's ``DotProductAttention`` refuses ``PackedSeqParams``. This module takes the same
arguments and supports both layouts:

- ``sbhd`` (ordinary batches): causal attention over each row; right padding is harmless because
  a causal mask never lets a real token see a later pad token.
- ``thd`` (packed): the 1-D micro-batch is split at ``cu_seqlens_q`` and each sequence attends
  causally to itself only. Per-segment calls cost sum(L_i^2) instead of the T^2 of one
  block-diagonal mask, which is what makes packing cheaper than padding.

Rotary positions restart at 0 per sequence: Megatron's ``apply_rotary_pos_emb`` already does this
for ``thd`` given ``cu_seqlens``, and ``GPTModel`` passes ``max_seqlen_q`` as the table length.
Shapes: q ``[s, b, np, hn]`` / ``[t, np, hn]``; k, v with ``ng`` query groups (GQA).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
        # torch.split, not x[start:end]: a slice's backward writes its gradient into a zeroed tensor
        # of the whole pack, once per sequence (48 sequences x q, k, v x 30 layers of full-size
        # zeros and adds per step); split's backward concatenates the sequences' gradients once.
        sizes = [end - start for start, end in zip(cu[:-1], cu[1:])]
        outs = [self._attend(*(x.transpose(0, 1).unsqueeze(0) for x in qkv)).squeeze(0).transpose(0, 1)
                for qkv in zip(*(torch.split(x, sizes, dim=0) for x in (query, key, value))) if qkv[0].size(0)]
        return torch.cat(outs, dim=0).reshape(query.size(0), -1)
