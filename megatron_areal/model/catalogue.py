"""Published models the planner and the simulator know by name, so a laptop can size a cluster run
whose weights it does not have. Anything else is read as an HF folder with ``load_arch``."""
from __future__ import annotations

from pathlib import Path

from megatron_areal.model.arch import ModelArch, arch_from_hf_config, load_arch


def _qwen2(v: int, h: int, i: int, layers: int, heads: int, kv: int, tie: bool, theta: float) -> ModelArch:
    return ModelArch(model_type="qwen2", vocab_size=v, hidden_size=h, intermediate_size=i, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=h // heads, max_position_embeddings=131072,
                     rms_norm_eps=1e-6, rope_theta=theta, rope_scaling=None, qkv_bias=True, qk_norm=False,
                     tie_word_embeddings=tie)


def _qwen3_moe(h: int, i: int, layers: int, heads: int, moe_i: int) -> ModelArch:
    """Qwen3-MoE: 128 experts, top-8 with renormalised weights, 4 KV heads of width 128, untied
    embeddings; ``i`` is the config's unused dense ``intermediate_size`` (every layer is MoE)."""
    return ModelArch(model_type="qwen3_moe", vocab_size=151936, hidden_size=h, intermediate_size=i,
                     num_layers=layers, num_heads=heads, num_kv_heads=4, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                     qkv_bias=False, qk_norm=True, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=moe_i, norm_topk_prob=True, router_aux_loss_coef=0.001)


# The fields of mistralai/Mixtral-8x7B-v0.1's and Qwen/Qwen2-57B-A14B's config.json that shape the
# model, read by the same parser as an HF folder (the same values appear in TensorRT-LLM's test
# fixtures MIXTRAL_8X7B_CONFIG and QWEN2_57B_A14B_CONFIG). tests/test_sim.py checks the counts
# against the published totals (46.7B with 12.9B active; 57B with 14B active).
_MIXTRAL_8X7B = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
                 "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
                 "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
_QWEN2_57B_A14B = {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                   "use_sliding_window": False, "decoder_sparse_step": 1, "num_experts": 64, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "norm_topk_prob": False,
                   "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "bos_token_id": 151643,
                   "eos_token_id": 151643}

# Shapes copied from each model's published config.json on the Hugging Face hub.
CATALOGUE: dict[str, ModelArch] = {
    "deepseek-r1-distill-qwen-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, False, 1e4),
    "deepseek-r1-distill-qwen-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False, 1e4),
    "deepseek-r1-distill-qwen-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, False, 1e6),
    "deepseek-r1-distill-qwen-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, False, 1e6),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True, 1e6),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False, 1e6),
    "qwen2.5-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, False, 1e6),
    "qwen2.5-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, False, 1e6),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: layers, heads (32/4 and 64/4 KV), 128 experts of
    # which 8 are active, and the totals (30.5B with 3.3B active; 235B with 22B active) from Qwen's
    # model cards on the Hugging Face hub; hidden 2048/4096, head_dim 128, expert width 768/1536,
    # vocab 151936, rope_theta 1e6, 40960 positions, aux-loss coefficient 0.001 and top-k
    # renormalisation as in their config.json (the same values appear in MindSpeed-RL's
    # configs/model/qwen3_30b_a3b.yaml and qwen3_235b_a22b.yaml). tests/test_sim.py checks the counts.
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 48, 32, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 94, 64, 1536),
    "mixtral-8x7b-v0.1": arch_from_hf_config(_MIXTRAL_8X7B, "mixtral-8x7b-v0.1"),
    "qwen2-57b-a14b": arch_from_hf_config(_QWEN2_57B_A14B, "qwen2-57b-a14b"),
}
ALIASES = {"1.5b": "deepseek-r1-distill-qwen-1.5b", "7b": "deepseek-r1-distill-qwen-7b",
           "14b": "deepseek-r1-distill-qwen-14b", "32b": "deepseek-r1-distill-qwen-32b",
           "30b-a3b": "qwen3-30b-a3b", "235b-a22b": "qwen3-235b-a22b", "mixtral-8x7b": "mixtral-8x7b-v0.1",
           "57b-a14b": "qwen2-57b-a14b"}


def resolve_arch(path: str) -> tuple[str, ModelArch]:
    """``(name, arch)`` of a catalogue name (case-insensitive; the last part of an HF id also works)
    or of an HF folder (named after the folder)."""
    key = ALIASES.get(path.lower().rstrip("/"), path.lower().rstrip("/"))
    tail = key.split("/")[-1]
    if key in CATALOGUE:
        return key, CATALOGUE[key]
    if Path(path).is_dir():
        return Path(path).name, load_arch(path)
    if tail in CATALOGUE:
        return tail, CATALOGUE[tail]
    raise ValueError(f"model.path {path!r} is neither a known model ({', '.join(CATALOGUE)}) "
                     "nor a Hugging Face folder with a config.json")
