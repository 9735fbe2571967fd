"""Model facts against transformers: RoPE frequencies, parameter counts, and one RoPE for all."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megatron_areal.model.arch import UnsupportedModelError, arch_from_hf_config
from megatron_areal.model.counts import param_count
from megatron_areal.model.rope import rope_inv_freq

SIZES = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_rope_frequencies_match_transformers(scaling):
    hf = LlamaConfig(**SIZES, rope_theta=500000.0, rope_scaling=scaling)
    ours = rope_inv_freq(arch_from_hf_config(hf.to_dict()))
    if scaling is None:
        want = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, want.float(), rtol=1e-6, atol=0)


def test_llama3_rope_without_its_keys_is_refused_by_name():
    arch = arch_from_hf_config(LlamaConfig(**SIZES, rope_scaling=LLAMA3).to_dict())
    partial = {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        rope_inv_freq(arch.__class__(**{**arch.to_dict(), "rope_scaling": partial}))


def test_trainer_and_server_share_one_rope():
    from megatron_areal.actor import model as actor_model
    from megatron_areal.server import model as server_model

    assert actor_model.rope_inv_freq is rope_inv_freq
    assert server_model.rope_inv_freq is rope_inv_freq


@pytest.mark.parametrize("config", [
    LlamaConfig(**SIZES, tie_word_embeddings=False),
    Qwen2Config(**SIZES, tie_word_embeddings=True),
    Qwen3Config(**SIZES, tie_word_embeddings=False),
    Qwen3MoeConfig(**SIZES, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2),
    Qwen2MoeConfig(**SIZES, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                   num_experts_per_tok=2),
    MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2),
], ids=["llama", "qwen2-tied", "qwen3", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_param_count_matches_the_hf_model(config):
    model = AutoModelForCausalLM.from_config(config)
    assert param_count(arch_from_hf_config(config.to_dict())) == sum(p.numel() for p in model.parameters())
