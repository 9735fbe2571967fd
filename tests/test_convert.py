"""HF <-> Megatron conversion: the mapping, bitwise round trips at TP2 PP2, and bad input.

SmolLM2-135M (9 heads, 3 KV heads: TP must be 1 or 3) is converted in test_score.py, whose
six-rank pool fits its TP3 PP2 layout.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_areal.checkpoint.dist_ckpt import CheckpointMismatchError, CheckpointReadError
from megatron_areal.convert.convert import hf_to_mcore, mcore_to_hf
from megatron_areal.model import mapping
from megatron_areal.model.arch import UnsupportedModelError, load_arch
from megatron_areal.model.hf_io import HFFormatError

# ---------------------------------------------------------------- mapping (pure)


def _random_hf(arch):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(mapping.hf_shape(arch, n), generator=g) for n in mapping.hf_tensor_names(arch)}


def test_qkv_rows_are_grouped_per_kv_head(tiny_qwen2):
    arch = load_arch(tiny_qwen2)  # 4 query heads, 2 KV groups, head_dim 16
    hd, h = arch.head_dim, arch.hidden_size
    # Row r of each projection carries its own head index: q heads 0..3, k heads 10.., v heads 20..
    q = torch.arange(arch.num_heads).repeat_interleave(hd)[:, None].expand(-1, h).float()
    k = (10 + torch.arange(arch.num_kv_heads)).repeat_interleave(hd)[:, None].expand(-1, h).float()
    v = (20 + torch.arange(arch.num_kv_heads)).repeat_interleave(hd)[:, None].expand(-1, h).float()
    fused = mapping.join(arch, "decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v], 0)
    heads = fused[::hd, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]  # [q, q, k, v] per group


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_join_split_shard_gather_round_trip(fixture, request):
    arch = load_arch(request.getfixturevalue(fixture))
    hf = _random_hf(arch)
    padded = arch.padded_vocab_size(2)
    for name in mapping.mcore_names(arch):
        full = mapping.join(arch, name, [hf[n] for n in mapping.hf_names(arch, name)], padded)
        shards = [mapping.shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(mapping.gather(name, shards), full)
        back = dict(mapping.split(arch, name, full))
        assert set(back) == set(mapping.hf_names(arch, name))
        for n, t in back.items():
            assert torch.equal(t, hf[n]), n


def test_fused_gate_up_keeps_both_halves_on_each_tp_rank(tiny_llama):
    arch = load_arch(tiny_llama)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    gate = torch.zeros(arch.intermediate_size, arch.hidden_size)
    up = torch.ones(arch.intermediate_size, arch.hidden_size)
    local = mapping.shard(name, mapping.join(arch, name, [gate, up], 0), 1, 2)
    half = arch.intermediate_size // 2
    assert local.shape[0] == arch.intermediate_size
    assert local[:half].eq(0).all() and local[half:].eq(1).all()


def test_te_names_and_stage_offsets(tiny_qwen2):
    arch = load_arch(tiny_qwen2)
    assert mapping.canonical("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert mapping.te_name("decoder.layers.3.pre_mlp_layernorm.weight") == \
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    assert mapping.global_name("decoder.layers.1.mlp.linear_fc2.weight", 6) == "decoder.layers.7.mlp.linear_fc2.weight"
    assert mapping.hf_names(arch, "decoder.layers.7.mlp.linear_fc2.weight") == ("model.layers.7.mlp.down_proj.weight",)
    with pytest.raises(mapping.MappingError, match="no HF mapping"):
        mapping.hf_names(arch, "decoder.layers.0.self_attention.linear_q_down_proj.weight")  # MLA: not supported


# ---------------------------------------------------------------- round trips through a TP2 PP2 checkpoint


@pytest.fixture(scope="module")
def pool():
    from megatron_areal.convert.spawn import WorkerPool

    with WorkerPool(4, timeout_s=600) as p:
        yield p


def export_stage(hf_dir: str, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Worker: load HF weights into this rank's stage, export them back (TP-gathered) as HF tensors."""
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.weights import export_hf_weights, load_hf_weights

    arch = load_arch(hf_dir)
    groups = init_parallel(tp=tp, pp=pp, backend="gloo")
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, hf_dir, arch, groups.tp_rank, groups.tp)
    out = {name: t.clone() for name, t in export_hf_weights(chunks, arch, groups.tp_group, groups.tp)}
    teardown_parallel()
    return out


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
def test_live_model_export_gives_back_the_hf_tensors(fixture, request, pool):
    hf_dir = request.getfixturevalue(fixture)
    per_rank = pool.run(export_stage, str(hf_dir), 2, 2)
    ref = load_file(str(hf_dir / "model.safetensors"))
    for rank, exported in enumerate(per_rank):  # ranks 0, 1: first stage; 2, 3: last stage
        assert set(exported) < set(ref)
        for name, t in exported.items():
            assert torch.equal(t, ref[name]), (rank, name)
    assert set(per_rank[0]) | set(per_rank[2]) == set(ref)
    assert per_rank[0].keys() == per_rank[1].keys()  # both TP ranks yield every tensor of the stage


def _bitwise_equal(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
def llama_ckpt(pool, tiny_llama, tmp_path_factory):
    return hf_to_mcore(tiny_llama, tmp_path_factory.mktemp("llama") / "ckpt", tp=2, pp=2, pool=pool)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_hf_to_mcore_to_hf_is_bitwise_identical(fixture, request, pool, llama_ckpt, tmp_path):
    src = request.getfixturevalue(fixture)
    ckpt = llama_ckpt if fixture == "tiny_llama" else hf_to_mcore(src, tmp_path / "ckpt", tp=2, pp=2, pool=pool)
    assert (ckpt / "metadata.json").is_file() and len(list(ckpt.glob("*.distcp"))) >= 4  # four ranks wrote
    out = mcore_to_hf(ckpt, tmp_path / "hf")
    _bitwise_equal(src, out)
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    assert json.loads((ckpt / "megatron_areal.json").read_text())["saved_tp"] == 2


def test_converted_folder_loads_in_transformers(llama_ckpt, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = mcore_to_hf(llama_ckpt, tmp_path / "hf")
    ids = torch.tensor([[5, 9, 40, 77, 3, 12]])
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)(ids).logits
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hi").input_ids == AutoTokenizer.from_pretrained(tiny_llama)("hi").input_ids


# ---------------------------------------------------------------- bad input


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type_lists_supported(tiny_llama, tmp_path):
    src = _copy_model(tiny_llama, tmp_path / "m")
    _edit_config(src, model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"config.json.*'gpt2'.*llama, qwen2, qwen3"):
        hf_to_mcore(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_safetensors_names_the_file(tiny_llama, tmp_path):
    src = _copy_model(tiny_llama, tmp_path / "m")
    (src / "model.safetensors").unlink()
    with pytest.raises(HFFormatError, match=r"model\.safetensors: missing"):
        hf_to_mcore(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors_names_the_file(tiny_llama, tmp_path):
    src = _copy_model(tiny_llama, tmp_path / "m")
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(HFFormatError, match=rf"{path}: (truncated|unreadable)"):
        hf_to_mcore(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shape_not_matching_config_names_tensor_and_file(tiny_llama, tmp_path):
    src = _copy_model(tiny_llama, tmp_path / "m")
    _edit_config(src, intermediate_size=96)
    with pytest.raises(HFFormatError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' "
                                            r"has shape \(128, 64\).*config\.json implies \(96, 64\)"):
        hf_to_mcore(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoint_of_another_model_is_refused(llama_ckpt, tiny_qwen3, tmp_path):
    ckpt = shutil.copytree(llama_ckpt, tmp_path / "ckpt")
    shutil.copy(tiny_qwen3 / "config.json", ckpt / "hf" / "config.json")  # claims to be another model
    with pytest.raises(CheckpointMismatchError, match=r"megatron_areal\.json: checkpoint is of another model"):
        mcore_to_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match=r"megatron_areal\.json: missing"):
        mcore_to_hf(tmp_path, tmp_path / "out")


def test_failure_while_reading_leaves_no_output(llama_ckpt, tmp_path):
    ckpt = shutil.copytree(llama_ckpt, tmp_path / "ckpt")
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointReadError, match=rf"{ckpt}: cannot read the checkpoint's tensors"):
        mcore_to_hf(ckpt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_existing_output_is_not_overwritten(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        hf_to_mcore(tiny_llama, out)
    assert (out / "keep.txt").read_text() == "x"


def test_cli_reports_bad_input_in_one_line(tiny_llama, tmp_path, capsys):
    from megatron_areal.convert.cli import main

    src = _copy_model(tiny_llama, tmp_path / "m")
    _edit_config(src, model_type="mistral")
    assert main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "supported: llama, qwen2, qwen3" in err
    assert main(["hf-to-mcore", "--hf", str(tiny_llama), "--out", str(tmp_path / "o2"), "--tp", "3"]) == 1
    assert "tp=3" in capsys.readouterr().err


def test_sharded_folder_reads_like_single_file_and_missing_shard_is_named(tiny_qwen2, tmp_path):
    from megatron_areal.model.hf_io import INDEX, HFReader, copy_non_weights, write_hf_weights

    arch = load_arch(tiny_qwen2)
    single = HFReader(tiny_qwen2, arch)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    copy_non_weights(tiny_qwen2, sharded)
    write_hf_weights(sharded, ((n, single.get(n)) for n in mapping.hf_tensor_names(arch)), max_shard_bytes=100_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / INDEX).is_file()
    reader = HFReader(sharded, arch)
    for name in mapping.hf_tensor_names(arch):
        assert torch.equal(reader.get(name), single.get(name)), name
    shards[1].unlink()
    with pytest.raises(HFFormatError, match=rf"{shards[1]}: shard listed in .*{INDEX} is missing"):
        HFReader(sharded, arch)


def test_tensor_without_megatron_counterpart_is_refused(tiny_llama, tmp_path):
    from safetensors.torch import save_file

    src = _copy_model(tiny_llama, tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # Llama with attention_bias
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' "
                                            r"has no Megatron counterpart"):
        hf_to_mcore(src, tmp_path / "out")
