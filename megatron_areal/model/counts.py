"""Parameter, byte and FLOP counts of a ``ModelArch``: what the planner's memory checks and the
simulator's cost model need, computed from the architecture facts only (no weights loaded)."""
from __future__ import annotations

from megatron_areal.model.arch import ModelArch

BF16_BYTES = 2
# Bytes per parameter of the trainer's model state in bf16 mixed precision (Megatron's accounting):
# bf16 weights 2 + fp32 gradients 4, plus fp32 master weights 4 and Adam moments 4 + 4, which the
# distributed optimizer shards over data-parallel ranks.
WEIGHT_GRAD_BYTES = 6
OPTIMIZER_BYTES = 12


def layer_params(arch: ModelArch) -> int:
    """Parameters of one transformer layer (attention, SwiGLU MLP, norms)."""
    h, d = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_heads * d, arch.num_kv_heads * d
    bias = q_out + 2 * kv_out if arch.qkv_bias else 0
    attention = h * q_out + 2 * h * kv_out + bias + q_out * h
    mlp = 3 * h * arch.intermediate_size  # gate, up, down
    norms = 2 * h + (2 * d if arch.qk_norm else 0)
    return attention + mlp + norms


def param_count(arch: ModelArch) -> int:
    """Total parameters (what is stored, sent and optimised)."""
    embedding = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embedding
    return arch.num_layers * layer_params(arch) + embedding + head + arch.hidden_size


def matmul_params(arch: ModelArch) -> int:
    """Parameters that cost 2 FLOPs per token forward: all layers plus the LM head (the input
    embedding is a lookup, free; a tied head still costs its matmul)."""
    return arch.num_layers * layer_params(arch) + arch.vocab_size * arch.hidden_size


def attention_width(arch: ModelArch) -> int:
    """Width of the attention products (query heads x head_dim): 2 FLOPs per cached token each."""
    return arch.num_heads * arch.head_dim


def weight_bytes(arch: ModelArch) -> int:
    """The weights in bf16."""
    return param_count(arch) * BF16_BYTES


def kv_bytes_per_token(arch: ModelArch) -> int:
    """K and V of every layer for one token, bf16."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * BF16_BYTES
