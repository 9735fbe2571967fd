"""A decoder-only transformer for the Llama, Qwen2 and Qwen3 dense families, Qwen3-MoE and Mixtral, over a
packed batch and a slot KV cache.

Module names mirror the Hugging Face checkpoints, so ``state_dict()`` keys are the HF tensor names
and weights load (from disk or from the trainer) without a name map.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_areal.model.arch import ModelArch
from megatron_areal.model.rope import rope_inv_freq
from megatron_areal.server.attention import ForwardBatch, packed_attention
from megatron_areal.server.kv_cache import KVCache
from megatron_areal.server.moe import GatedMLP, SparseMoE
from megatron_areal.server.packed_linear import FusedLinear


class RMSNorm(nn.Module):
    """RMS normalisation in fp32, scaled by the weight in fp32 and rounded to the input's dtype once.

    This is SGLang's ``RMSNorm.forward_native`` default and what ``torch.rms_norm`` (the trainer's
    local-spec norm) computes. Transformers' form instead rounds the normalised input to bf16 and
    then multiplies by the bf16 weight, rounding twice: in bf16 that is further from the exact
    value, differs from ``torch.rms_norm`` in about a quarter of the outputs of random inputs, and
    was about half of the bf16 train/rollout logprob gap left with routing replay (bench/moe_replay.py).
    In fp32 both forms give the same values.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/signed_sin: [B, T, 1, D] (``rope_tables``).

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, as
    ``roll(x) * cat(-sin1, sin2)``: the same products (only a sign moves), one op instead of three.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the sign-folded sin of ``apply_rope`` for ``positions`` [B, T]: [B, T, 1, D] each."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self._qkv, self._o = FusedLinear(self.q_proj, self.k_proj, self.v_proj), FusedLinear(self.o_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                batch: ForwardBatch) -> torch.Tensor:
        b, t, _ = x.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv(x).view(b, t, heads + 2 * kv_heads, d)
        if self.qk_norm:
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        else:  # queries and keys side by side in one rotation
            qk = apply_rope(qkv[:, :, :heads + kv_heads], cos, sin)
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads:]
        out = packed_attention(q[0], k[0], v[0], cache, layer, batch)  # the batch is one packed row
        return self._o(out.reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.is_moe = arch.is_moe
        mlp = SparseMoE(arch) if arch.is_moe else GatedMLP(arch.hidden_size, arch.intermediate_size)
        self.add_module(arch.hf_moe_block if arch.is_moe else "mlp", mlp)  # Mixtral: block_sparse_moe
        self._mlp = (mlp,)  # a tuple: not registered a second time
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                batch: ForwardBatch, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, batch)
        h = self.post_attention_layernorm(x)
        mlp = self._mlp[0]
        return x + (mlp(h, routes) if self.is_moe else mlp(h))


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.model.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self._output = FusedLinear(self.model.embed_tokens if arch.tie_word_embeddings else self.lm_head)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """tokens [1, N] (the batch's rows packed) -> fp32 logits of each row's last token, [rows, vocab].

        With ``routes`` (a MoE model), each layer appends the experts it chose per token, [N, top_k].
        """
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_tables(batch.positions, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, batch, routes)
        last = x[0, batch.last]
        return self._output(self.model.norm(last)).float()
