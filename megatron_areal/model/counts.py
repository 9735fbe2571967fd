"""Parameter, byte and FLOP counts of a ``ModelArch``: what the planner's memory checks and the
simulator's cost model need, computed from the architecture facts only (no weights loaded).

Mixture-of-Experts models have two parameter counts. *Total* parameters are what is stored, sent to
the servers and optimised; *active* parameters are what one token passes through (attention, the
router and its ``num_experts_per_tok`` experts), so FLOPs per token follow the active count. Expert
weights are split over expert parallelism (EP) and expert tensor parallelism (ETP) in the trainer;
everything else over TP as in a dense model.
"""
from __future__ import annotations

from megatron_areal.model.arch import ModelArch

BF16_BYTES = 2
# Bytes per parameter of the trainer's model state in bf16 mixed precision (Megatron's accounting):
# bf16 weights 2 + fp32 gradients 4, plus fp32 master weights 4 and Adam moments 4 + 4, which the
# distributed optimizer shards over data-parallel ranks.
WEIGHT_GRAD_BYTES = 6
OPTIMIZER_BYTES = 12


def attention_params(arch: ModelArch) -> int:
    """Q, K, V and output projections of one layer (with Qwen2's q/k/v bias)."""
    h, d = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_heads * d, arch.num_kv_heads * d
    bias = q_out + 2 * kv_out if arch.qkv_bias else 0
    return h * q_out + 2 * h * kv_out + bias + q_out * h


def expert_params(arch: ModelArch) -> int:
    """One expert's SwiGLU MLP (gate, up, down); 0 for a dense model."""
    return 3 * arch.hidden_size * arch.moe_intermediate_size if arch.is_moe else 0


def _shared_layer_params(arch: ModelArch) -> int:
    """What every token of a layer uses: attention, norms, the router and shared expert (MoE) or the dense MLP."""
    h = arch.hidden_size
    norms = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    shared = 3 * h * arch.shared_expert_intermediate_size + h if arch.shared_expert_intermediate_size else 0
    mlp = h * arch.num_experts + shared if arch.is_moe else 3 * h * arch.intermediate_size
    return attention_params(arch) + norms + mlp


def layer_params(arch: ModelArch) -> int:
    """Parameters of one transformer layer (attention, MLP or router + all experts, norms)."""
    return _shared_layer_params(arch) + arch.num_experts * expert_params(arch)


def active_layer_params(arch: ModelArch) -> int:
    """Parameters of one layer that one token passes through (its top-k experts only)."""
    return _shared_layer_params(arch) + arch.num_experts_per_tok * expert_params(arch)


def _embeddings(arch: ModelArch) -> int:
    embedding = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embedding
    return embedding + head + arch.hidden_size  # + the final norm


def param_count(arch: ModelArch) -> int:
    """Total parameters (what is stored, sent and optimised)."""
    return arch.num_layers * layer_params(arch) + _embeddings(arch)


def active_param_count(arch: ModelArch) -> int:
    """Parameters one token uses (the "A3B" of Qwen3-30B-A3B); equal to ``param_count`` if dense."""
    return arch.num_layers * active_layer_params(arch) + _embeddings(arch)


def expert_param_count(arch: ModelArch) -> int:
    """Parameters in experts (split over EP x ETP in the trainer); 0 for a dense model."""
    return arch.num_layers * arch.num_experts * expert_params(arch)


def matmul_params(arch: ModelArch) -> int:
    """Parameters that cost 2 FLOPs per token forward: every layer's active part plus the LM head
    (the input embedding is a lookup, free; a tied head still costs its matmul)."""
    return arch.num_layers * active_layer_params(arch) + arch.vocab_size * arch.hidden_size


def attention_width(arch: ModelArch) -> int:
    """Width of the attention products (query heads x head_dim): 2 FLOPs per cached token each."""
    return arch.num_heads * arch.head_dim


def weight_bytes(arch: ModelArch) -> int:
    """The weights in bf16."""
    return param_count(arch) * BF16_BYTES


def kv_bytes_per_token(arch: ModelArch) -> int:
    """K and V of every layer for one token, bf16."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * BF16_BYTES


def dispatch_bytes_per_token(arch: ModelArch) -> int:
    """Bytes one token's hidden states travel per forward pass in MoE layers: every layer sends
    ``num_experts_per_tok`` bf16 copies to its experts (dispatch) and gets as many back (combine).
    A backward pass moves the same again (the gradients); 0 for a dense model."""
    return 2 * arch.num_layers * arch.num_experts_per_tok * arch.hidden_size * BF16_BYTES


def trainer_state_bytes(arch: ModelArch, *, tp: int, pp: int, dp: int, ep: int = 1, etp: int = 1,
                        distributed_optimizer: bool = True) -> float:
    """Weights, gradients and Adam state per trainer GPU. Non-expert parameters are split over
    TP x PP and their optimizer state over DP; expert parameters over ETP x EP x PP and their
    optimizer state over the expert data-parallel ranks, ``tp * dp / (etp * ep)`` of them."""
    expert = expert_param_count(arch)
    dense = param_count(arch) - expert
    edp = max(tp * dp // (etp * ep), 1)
    dense_opt = dp if distributed_optimizer else 1
    expert_opt = edp if distributed_optimizer else 1
    return (dense * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / max(dense_opt, 1)) / (tp * pp)
            + expert * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / expert_opt) / (etp * ep * pp))
