"""The transfer plan (``weights/plan.py``): every element of every server tensor arrives exactly once, and
the slices the trainer ranks cut from their own shards are the HF checkpoint's values.

References: the HF tensor names and shapes the model's config implies (``mapping.hf_tensor_names`` /
``hf_shape``: what a server loads) for coverage, and for the values a random HF state dict put into TP
shards by the conversion's own path (``mapping.join`` + ``mapping.shard``, what ``load_hf_weights``
does), sliced by each sender and reassembled on each receiver.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.slices import shard_tensors
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, make_plan

DENSE = ModelArch(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=1e4, rope_scaling=None, qkv_bias=True, qk_norm=False, tie_word_embeddings=False)
TIED = ModelArch(**{**DENSE.to_dict(), "model_type": "qwen3", "qkv_bias": False, "qk_norm": True,
                    "tie_word_embeddings": True})
MOE = ModelArch(model_type="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
                rope_theta=1e4, rope_scaling=None, qkv_bias=False, qk_norm=True, tie_word_embeddings=False,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

LAYOUTS = [TrainerLayout(tp, pp, dp) for tp, pp, dp in itertools.product((1, 2, 4), (1, 2), (1, 2))]
MOE_LAYOUTS = [TrainerLayout(tp, pp, dp, ep, etp)
               for tp, pp, dp, ep, etp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2, 4), (1, 2))
               if (tp * dp) % (ep * etp) == 0 and tp * dp <= 4]
SERVERS = [ServerLayout(2, 1), ServerLayout(2, 2, sharded=True), ServerLayout(1, 2, sharded=False)]


def _coverage(plan, arch: ModelArch) -> None:
    needed = {name: mapping.hf_shape(arch, name) for name in mapping.hf_tensor_names(arch)}
    if arch.tie_word_embeddings:
        needed.pop("lm_head.weight", None)
    for receiver in plan.servers.receivers:
        counts = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in needed.items()}
        for t in plan.transfers_to(receiver):
            assert t.slice.shape == tuple(needed[t.slice.name]), t
            counts[t.slice.name].narrow(t.slice.dim, t.slice.start, t.slice.stop - t.slice.start).add_(1)
        for name, c in counts.items():
            dim = plan.split_dims[name]
            if plan.servers.sharded and dim is not None and plan.servers.tp > 1:
                n = c.shape[dim]
                lo, hi = n * receiver[1] // plan.servers.tp, n * (receiver[1] + 1) // plan.servers.tp
                want = torch.zeros_like(c)
                want.narrow(dim, lo, hi - lo).fill_(1)
            else:
                want = torch.ones_like(c)
            assert torch.equal(c, want), f"{name} at {receiver}: elements covered {c.unique().tolist()} times"


@pytest.mark.parametrize("servers", SERVERS, ids=str)
@pytest.mark.parametrize("trainer", LAYOUTS, ids=str)
@pytest.mark.parametrize("arch", [DENSE, TIED], ids=["qwen2", "qwen3-tied"])
def test_dense_every_server_element_exactly_once(arch: ModelArch, trainer: TrainerLayout,
                                                 servers: ServerLayout) -> None:
    _coverage(make_plan(arch, trainer, servers), arch)


@pytest.mark.parametrize("servers", SERVERS[:2], ids=str)
@pytest.mark.parametrize("trainer", MOE_LAYOUTS, ids=str)
def test_moe_every_server_element_exactly_once(trainer: TrainerLayout, servers: ServerLayout) -> None:
    _coverage(make_plan(MOE, trainer, servers), MOE)


def _hf_state(arch: ModelArch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(mapping.hf_shape(arch, n), generator=g) for n in mapping.hf_tensor_names(arch)}
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize(("arch", "trainer"), [
    (DENSE, TrainerLayout(2, 2)), (DENSE, TrainerLayout(4, 1)), (TIED, TrainerLayout(2, 2)),
    (MOE, TrainerLayout(2, 2, 1, 2, 1)), (MOE, TrainerLayout(2, 1, 2, 4, 1)), (MOE, TrainerLayout(2, 1, 1, 1, 2)),
], ids=str)
@pytest.mark.parametrize("servers", [ServerLayout(1, 1), ServerLayout(1, 2, sharded=True)], ids=str)
def test_slices_cut_from_own_shards_reassemble_the_hf_checkpoint(arch: ModelArch, trainer: TrainerLayout,
                                                                   servers: ServerLayout) -> None:
    hf = _hf_state(arch)
    plan = make_plan(arch, trainer, servers)
    for receiver in servers.receivers:
        got = {n: torch.full_like(t, float("nan")) for n, t in hf.items()}
        cut: dict[tuple[int, str], dict] = {}
        for t in plan.transfers_to(receiver):
            key = (t.sender, t.source)
            if key not in cut:  # what the sender holds of the parameter, from the conversion's sharding
                full = mapping.join(arch, t.source, [hf[h] if h in hf else hf["model.embed_tokens.weight"]
                                                     for h in mapping.hf_names(arch, t.source)],
                                    arch.padded_vocab_size(trainer.tp))
                shard, size = trainer.shard_of(t.sender, mapping.is_expert(t.source))
                local = mapping.shard(t.source, full, shard, size)
                cut[key] = {s.name: (s, v) for s, v in shard_tensors(arch, t.source, local, shard, size)}
            whole, values = cut[key][t.slice.name]
            part = values.narrow(t.slice.dim, t.slice.start - whole.start, t.slice.stop - t.slice.start)
            got[t.slice.name].narrow(t.slice.dim, t.slice.start, t.slice.stop - t.slice.start).copy_(part)
        for name, want in hf.items():
            dim = plan.split_dims[name]
            if servers.sharded and dim is not None and servers.tp > 1:
                n = want.shape[dim]
                lo, hi = n * receiver[1] // servers.tp, n * (receiver[1] + 1) // servers.tp
                want, got[name] = want.narrow(dim, lo, hi - lo), got[name].narrow(dim, lo, hi - lo)
            assert torch.equal(got[name], want), f"{name} at {receiver}"


def test_no_rank_gathers_a_stage_busiest_share_at_tp2_pp2() -> None:
    """Every rank sends about its own share; a stage-head push puts everything on two of four ranks."""
    plan = make_plan(DENSE, TrainerLayout(2, 2), ServerLayout(2, 2, sharded=True))
    sent = plan.bytes_per_sender()
    assert all(n > 0 for n in sent.values()) and plan.senders == [0, 1, 2, 3]
    assert plan.busiest_share() <= 1.25, (plan.busiest_share(), sent)


def test_moe_experts_leave_from_the_ranks_that_hold_them() -> None:
    trainer = TrainerLayout(tp=2, pp=1, dp=2, ep=4, etp=1)
    plan = make_plan(MOE, trainer, ServerLayout(1))
    for p in plan.pieces:
        e = mapping.expert_index(p.source)
        if e is not None:
            assert p.sender == e // 2, (p.source, p.sender)  # 2 experts per EP rank, ranks 0..3 of the stage
    assert plan.senders == [0, 1, 2, 3]


def test_summary_names_the_busiest_rank() -> None:
    text = make_plan(MOE, TrainerLayout(2, 2, 1, 2, 1), ServerLayout(2, 2)).summary()
    assert "busiest: trainer rank" in text and "stage-head push: 2.00" in text


def test_data_parallel_replicas_share_the_servers() -> None:
    """Replica d serves servers d, d + dp, ...: with two replicas and two servers all four ranks send."""
    plan = make_plan(DENSE, TrainerLayout(2, 1, 2), ServerLayout(2))
    assert plan.senders == [0, 1, 2, 3]
    assert {t.sender for t in plan.transfers_to((1, 0))} == {2, 3}
    assert plan.busiest_share() <= 1.25


def test_dry_run_prints_the_push_plan_for_the_512_gpu_configs() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for config, layout in (("train_32b", "tp=8 pp=2 dp=8"), ("train_qwen3_235b_a22b", "tp=4 pp=2 dp=16 ep=16")):
        out = subprocess.run([sys.executable, "-m", "megatron_areal.cli", "train", f"configs/{config}.yaml",
                              "--dry-run", "--nodes", "64", "--gpus-per-node", "8"], cwd=root, capture_output=True,
                             text=True, timeout=300).stdout
        assert f"weight push plan: trainer {layout}" in out, out[-2000:]
        assert "busiest: trainer rank" in out and "SGLang: each stage's head sends its stage" in out
