"""Qwen3-MoE on the Megatron side: the HF <-> Megatron mapping of routers and experts.

The tiny model comes from transformers (tests/tiny_moe.py), so the HF names and shapes checked here
are the ones transformers writes.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tiny_moe import make_tiny_qwen3_moe

from megatron_areal.model import mapping
from megatron_areal.model.arch import load_arch
from megatron_areal.model.hf_io import HFReader


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "topk_norm", norm_topk_prob=True)


def test_every_hf_tensor_has_one_megatron_home(tiny_moe):
    arch = load_arch(tiny_moe)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 40)
    written = set(load_file(str(tiny_moe / "model.safetensors")))
    mapped = mapping.hf_tensor_names(arch)
    assert len(mapped) == len(set(mapped)) and set(mapped) == written
    HFReader(tiny_moe, arch)  # every tensor present with the shape the config implies
    assert mapping.hf_names("decoder.layers.1.mlp.router.weight") == ("model.layers.1.mlp.gate.weight",)
    assert mapping.hf_names("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight") == (
        "model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(mapping.MappingError, match="mlp.experts.9.down_proj"):
        mapping.hf_shape(arch, "model.layers.0.mlp.experts.9.down_proj.weight")
    with pytest.raises(mapping.MappingError, match="not part of a qwen3_moe model"):
        mapping.hf_shape(arch, "model.layers.0.mlp.down_proj.weight")


def test_expert_names_are_global_over_expert_parallel_ranks():
    # EP rank 1 of 2 holds experts 4..7 as its local experts 0..3; pipeline stage offset 1 layer
    local = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"
    name = mapping.global_name(local, 1, expert_offset=4)
    assert name == "decoder.layers.1.mlp.experts.local_experts.6.linear_fc2.weight"
    assert mapping.expert_index(name) == 6 and not mapping.is_expert("decoder.layers.1.mlp.router.weight")
    assert mapping.global_name("decoder.layers.0.mlp.router.weight", 1, expert_offset=4) == \
        "decoder.layers.1.mlp.router.weight"


def test_join_split_shard_gather_round_trip(tiny_moe):
    arch = load_arch(tiny_moe)
    hf = {k: v for k, v in load_file(str(tiny_moe / "model.safetensors")).items()}
    padded = arch.padded_vocab_size(2)
    for name in mapping.mcore_names(arch):
        full = mapping.join(arch, name, [hf[n] for n in mapping.hf_names(name)], padded)
        shards = [mapping.shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(mapping.gather(name, shards), full)
        for n, t in mapping.split(arch, name, full):
            assert torch.equal(t, hf[n]), n
    fc1 = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    gate, up = hf["model.layers.0.mlp.experts.3.gate_proj.weight"], hf["model.layers.0.mlp.experts.3.up_proj.weight"]
    local = mapping.shard(fc1, mapping.join(arch, fc1, [gate, up], 0), 1, 2)  # expert-TP rank 1 of 2
    assert torch.equal(local, torch.cat([gate[20:], up[20:]]))


def test_layouts_the_experts_cannot_split_into_are_refused(tiny_moe, tiny_qwen3):
    arch = load_arch(tiny_moe)
    mapping.check_ep(arch, 8, 2)
    with pytest.raises(ValueError, match="parallel.ep=3 must divide the model's num_experts=8"):
        mapping.check_ep(arch, 3, 1)
    with pytest.raises(ValueError, match="parallel.etp=3 must divide the model's moe_intermediate_size=40"):
        mapping.check_ep(arch, 2, 3)
    with pytest.raises(ValueError, match="parallel.ep=2 .* qwen3 has no experts"):
        mapping.check_ep(load_arch(tiny_qwen3), 2, 1)
