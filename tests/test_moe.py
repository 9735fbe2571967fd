"""Qwen3-MoE on the Megatron side: the HF <-> Megatron mapping of routers and experts.

The tiny model comes from transformers (tests/tiny_moe.py), so the HF names and shapes checked here
are the ones transformers writes.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from tiny_moe import hf_logprobs, make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe, router_margin

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
    assert mapping.hf_names(arch, "decoder.layers.1.mlp.router.weight") == ("model.layers.1.mlp.gate.weight",)
    assert mapping.hf_names(arch, "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight") == (
        "model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(mapping.MappingError, match="mlp.experts.9.down_proj"):
        mapping.hf_shape(arch, "model.layers.0.mlp.experts.9.down_proj.weight")
    with pytest.raises(mapping.MappingError, match="not part of a qwen3_moe model"):
        mapping.hf_shape(arch, "model.layers.0.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return make_tiny_mixtral(tmp_path_factory.mktemp("moe") / "mixtral", seed=2)


def test_mixtral_tensors_have_their_own_names(tiny_mixtral):
    """Mixtral keeps the router and experts under ``block_sparse_moe`` with ``w1``/``w3``/``w2``
    (gate, up, down); the mapping reads every tensor transformers wrote, with its shape."""
    arch = load_arch(tiny_mixtral)
    assert (arch.model_type, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
            arch.norm_topk_prob, arch.qk_norm) == ("mixtral", 8, 2, 40, True, False)
    written = set(load_file(str(tiny_mixtral / "model.safetensors")))
    mapped = mapping.hf_tensor_names(arch)
    assert len(mapped) == len(set(mapped)) and set(mapped) == written
    HFReader(tiny_mixtral, arch)
    assert mapping.hf_names(arch, "decoder.layers.1.mlp.router.weight") == (
        "model.layers.1.block_sparse_moe.gate.weight",)
    assert mapping.hf_names(arch, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == (
        "model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.block_sparse_moe.experts.3.w3.weight")
    assert mapping.hf_names(arch, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight") == (
        "model.layers.0.block_sparse_moe.experts.3.w2.weight",)
    with pytest.raises(mapping.MappingError, match="not part of a mixtral model"):
        mapping.hf_shape(arch, "model.layers.0.mlp.experts.3.gate_proj.weight")


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory):
    return make_tiny_qwen2_moe(tmp_path_factory.mktemp("moe") / "qwen2_moe", seed=3)


def test_qwen2_moe_shared_expert_has_one_megatron_home(tiny_qwen2_moe):
    """Qwen2-MoE's shared expert and its gate map to Megatron's shared_experts (split over TP like a
    dense MLP); every tensor transformers wrote is read with its shape."""
    arch = load_arch(tiny_qwen2_moe)
    assert (arch.model_type, arch.shared_expert_intermediate_size, arch.norm_topk_prob, arch.qkv_bias) == (
        "qwen2_moe", 56, False, True)
    written = set(load_file(str(tiny_qwen2_moe / "model.safetensors")))
    mapped = mapping.hf_tensor_names(arch)
    assert len(mapped) == len(set(mapped)) and set(mapped) == written
    HFReader(tiny_qwen2_moe, arch)
    assert mapping.hf_names(arch, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight") == (
        "model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight")
    assert mapping.hf_names(arch, "decoder.layers.1.mlp.shared_experts.gate_weight") == (
        "model.layers.1.mlp.shared_expert_gate.weight",)
    assert mapping.tp_dim("decoder.layers.1.mlp.shared_experts.linear_fc2.weight") == 1


def test_mixtral_with_sliding_window_attention_is_refused(tiny_mixtral, tmp_path):
    import json
    import shutil

    from megatron_areal.model.arch import UnsupportedModelError

    folder = shutil.copytree(tiny_mixtral, tmp_path / "windowed")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    with pytest.raises(UnsupportedModelError, match="sliding_window 64"):
        load_arch(folder)


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
        full = mapping.join(arch, name, [hf[n] for n in mapping.hf_names(arch, name)], padded)
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


# ---------------------------------------------------------------- multi-rank: one four-rank pool for every layout

TOLERANCE = 1e-4
LAYOUTS = [  # (tp, pp, ep, etp); the four-rank world makes the rest data parallel
    (1, 1, 2, 1),
    (2, 1, 2, 1),
    (1, 2, 2, 1),
    (2, 1, 2, 2),
]


@pytest.fixture(scope="module")
def pool():
    from megatron_areal.convert.spawn import WorkerPool

    with WorkerPool(4, timeout_s=900) as p:
        yield p


@pytest.fixture(scope="module")
def moe_no_norm(tmp_path_factory):
    """The other routing: the chosen experts keep their share of the full softmax."""
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "topk_raw", norm_topk_prob=False, seed=1)


def _sequences(n_tokens: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(130) for _ in range(n)] for n in n_tokens]


def _max_diff(got: list[list[float]], ref: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(r) for r in ref]
    return max((torch.tensor(g) - r).abs().max().item() for g, r in zip(got, ref, strict=True))


def test_logprobs_match_transformers_at_expert_parallel_layouts(tiny_moe, moe_no_norm, pool):
    from megatron_areal.convert.score import score

    sequences = _sequences([2, 23, 9, 31, 16])
    worst = {}
    for hf_dir, layouts in ((tiny_moe, LAYOUTS), (moe_no_norm, LAYOUTS[:3])):
        assert router_margin(hf_dir, sequences) > 1e-3  # no near-tie that float noise could flip
        ref = hf_logprobs(hf_dir, sequences)
        for tp, pp, ep, etp in layouts:
            got = score("hf", hf_dir, sequences, tp=tp, pp=pp, ep=ep, etp=etp, pool=pool)
            worst[hf_dir.name, tp, pp, ep, etp] = _max_diff(got, ref)
    print("max |logprob - transformers| per layout:", worst)
    assert max(worst.values()) <= TOLERANCE, worst


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_other_moe_families_logprobs_and_round_trip(family, tiny_mixtral, tiny_qwen2_moe, pool, tmp_path):
    """Mixtral and Qwen2-MoE: logprobs match transformers' at EP2, TP2 x EP2 (Qwen2-MoE's shared
    expert split over TP) and PP2 x EP2, and HF -> Megatron (saved at EP2) -> HF gives back every
    tensor bitwise under the family's names."""
    from megatron_areal.convert.convert import hf_to_mcore, mcore_to_hf
    from megatron_areal.convert.score import score

    hf_dir = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe}[family]
    sequences = _sequences([2, 23, 9, 31, 16])
    assert router_margin(hf_dir, sequences) > 1e-3
    ref = hf_logprobs(hf_dir, sequences)
    worst = {(tp, pp, ep): _max_diff(score("hf", hf_dir, sequences, tp=tp, pp=pp, ep=ep, pool=pool), ref)
             for tp, pp, ep in ((1, 1, 2), (2, 1, 2), (1, 2, 2))}
    print(f"{family}: max |logprob - transformers| per layout:", worst)
    assert max(worst.values()) <= TOLERANCE, worst
    back = mcore_to_hf(hf_to_mcore(hf_dir, tmp_path / "ckpt", ep=2, pool=pool), tmp_path / "hf")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def export_stage(hf_dir: str, tp: int, pp: int, ep: int, etp: int) -> dict[str, torch.Tensor]:
    """Worker: load HF weights into this rank's stage and export them back, gathered over TP, EP and expert TP."""
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.weights import export_hf_weights, load_hf_weights

    arch = load_arch(hf_dir)
    g = init_parallel(tp=tp, pp=pp, backend="gloo", ep=ep, etp=etp)
    chunks = build_model(arch, g)
    load_hf_weights(chunks, hf_dir, arch, g.tp_rank, g.tp, etp_rank=g.etp_rank, etp_size=g.etp)
    out = {n: t.clone() for n, t in export_hf_weights(chunks, arch, g.tp_group, g.tp, etp_group=g.etp_group,
                                                       etp_size=g.etp, ep_group=g.ep_group, ep_size=g.ep)}
    teardown_parallel()
    return out


def test_live_model_export_gives_back_every_expert(tiny_moe, pool):
    ref = load_file(str(tiny_moe / "model.safetensors"))
    for rank, exported in enumerate(pool.run(export_stage, str(tiny_moe), 2, 1, 2, 2)):
        assert set(exported) == set(ref), rank
        for name, t in exported.items():
            assert torch.equal(t, ref[name]), (rank, name)


def test_checkpoint_round_trip_and_load_at_other_layouts(tiny_moe, pool, tmp_path):
    from megatron_areal.convert.convert import hf_to_mcore, mcore_to_hf
    from megatron_areal.convert.score import score

    ckpt = hf_to_mcore(tiny_moe, tmp_path / "ckpt", ep=2, pool=pool)  # saved at EP2 (x DP4)
    back = mcore_to_hf(ckpt, tmp_path / "hf")
    a, b = load_file(str(tiny_moe / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    sequences = _sequences([12, 7, 20], seed=3)
    ref = hf_logprobs(tiny_moe, sequences)
    for tp, pp, ep in ((2, 1, 1), (1, 2, 2), (1, 1, 4)):  # EP2 -> EP1 x TP2, PP2 x EP2, EP4
        got = score("ckpt", ckpt, sequences, tp=tp, pp=pp, ep=ep, pool=pool)
        assert _max_diff(got, ref) <= TOLERANCE, (tp, pp, ep)


# ---------------------------------------------------------------- the actor: decoupled-PPO steps at EP layouts


def _trajectories(n: int = 8) -> list:
    from megatron_areal.records import Trajectory

    g = torch.Generator().manual_seed(0)
    shapes = [(5, 9), (3, 20), (7, 4), (4, 13), (6, 6), (2, 27), (8, 3), (5, 11)][:n]
    return [Trajectory(prompt_ids=torch.randint(0, 130, (p,), generator=g).tolist(),
                       output_ids=torch.randint(0, 130, (o,), generator=g).tolist(),
                       output_logprobs=(-4.9 + 0.3 * torch.randn(o, generator=g)).tolist(),
                       group_id=i // 4, reward=float(i % 3 == 0)) for i, (p, o) in enumerate(shapes)]


def case_actor(hf_dir: str, tp: int, pp: int, ep: int, n_trajectories: int = 8, n_minibatches: int = 2,
               aux_coef: float | None = None) -> dict:
    """Worker: logprobs, one decoupled-PPO update, logprobs again, at one layout (distributed optimizer).
    ``trained``: the training pass's micro-batches on this rank, as (sequence ids, packed length)."""
    from megatron_areal.actor import actor as actor_module
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.weights import load_hf_weights

    arch = load_arch(hf_dir)
    g = init_parallel(tp, pp, seed=3, backend="gloo", ep=ep)
    actor = Actor(arch, ModelConfig(max_seq_len=40, dtype="float32", router_aux_loss_coef=aux_coef),
                  ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1, max_tokens_per_mb=48),
                  OptimizerConfig(lr=1e-3, adam_eps=1e-4, clip_grad=1.0, distributed=True),
                  PPOConfig(n_minibatches=n_minibatches, behav_imp_weight_cap=5.0), g, seed=3, total_steps=4)
    load_hf_weights(actor.model, hf_dir, arch, g.tp_rank, g.tp, optimizer=actor.optimizer, etp_rank=g.etp_rank,
                    etp_size=g.etp)
    trajs = _trajectories(n_trajectories)
    seqs = [t.input_ids for t in trajs]
    before = actor.compute_logprobs(seqs)
    trained, run = [], actor_module.run_microbatches

    def recording(model, batches, *a, forward_only, **kw):
        if not forward_only:
            trained.extend((mb.seq_ids, mb.n_tokens) for mb in batches)
        return run(model, batches, *a, forward_only=forward_only, **kw)

    actor_module.run_microbatches = recording
    stats = actor.ppo_update(trajs)
    actor_module.run_microbatches = run
    after = actor.compute_logprobs(seqs)
    teardown_parallel()
    return {"before": [x.tolist() for x in before], "after": [x.tolist() for x in after], "stats": stats,
            "trained": trained, "dp_head": g.tp_rank == 0 and g.pp_rank == 0}


def _diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.mark.slow
def test_ppo_step_at_expert_parallel_layouts_matches_one_expert_rank(tiny_moe, pool):
    """EP2, TP2 x EP2 (sequence parallel) and PP2 x EP2 against EP1, all four ranks in each.

    The load-balancing loss is computed per micro-batch (its expert fractions are products over the
    micro-batch's tokens), so it is only layout-independent where the micro-batches are the same:
    EP2 keeps EP1's four data-parallel ranks and is compared with the loss on; TP2 and PP2 pack the
    batch differently (two DP ranks; 2 x PP micro-batches) and are compared with it off."""
    from megatron_areal.actor.ppo_batch import sequence_advantages

    trajs = _trajectories()
    ref = pool.run(case_actor, str(tiny_moe), 1, 1, 1)[0]  # EP1 (x DP4), the HF config's coefficient 0.01
    plain = pool.run(case_actor, str(tiny_moe), 1, 1, 1, aux_coef=0.0)[0]
    assert _max_diff(ref["before"], hf_logprobs(tiny_moe, [t.input_ids for t in trajs])) <= TOLERANCE
    # the update moved the policy towards the advantages: the advantage-weighted logprob rose
    adv = sequence_advantages(trajs, "grpo")
    for r in (ref, plain):
        assert sum(a * (sum(y) - sum(x)) for a, x, y in zip(adv, r["before"], r["after"])) > 0
    assert ref["stats"]["moe_aux_loss"] > 0 and "moe_aux_loss" not in plain["stats"]
    assert _diff(ref["after"], plain["after"]) > 1e-3  # the load-balancing loss reaches the router's gradient
    worst = {}
    for (tp, pp, ep, _), want, coef in zip(LAYOUTS[:3], (ref, plain, plain), (None, 0.0, 0.0)):
        for rank, r in enumerate(pool.run(case_actor, str(tiny_moe), tp, pp, ep, aux_coef=coef)):
            worst[tp, pp, ep] = max(worst.get((tp, pp, ep), 0.0), _diff(r["before"], want["before"]),
                                    _diff(r["after"], want["after"]))
            for key in ("loss", "grad_norm", "clip_fraction", "moe_aux_loss", "tokens"):
                assert r["stats"].get(key) == pytest.approx(want["stats"].get(key), rel=1e-4, abs=1e-6), \
                    (tp, pp, ep, rank, key)
    print("max |logprob - EP1| before/after the update:", worst)
    assert max(worst.values()) <= 2e-5, worst


def _switch_loss(hf_dir, trajectories: list, microbatches: list[list[int]]) -> float:
    """E * sum_e f_e * P_e (f: fraction of routed slots, P: mean router probability) over the tokens of
    each micro-batch, from transformers' router logits; the mean over layers and micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    arch = load_arch(hf_dir)
    with torch.no_grad():
        router = [model(torch.tensor([t.input_ids]), output_router_logits=True).router_logits for t in trajectories]
    losses = []
    for ids in microbatches:
        layers = []
        for layer in range(arch.num_layers):
            probs = torch.softmax(torch.cat([router[i][layer] for i in ids]).float(), dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(arch.num_experts_per_tok, dim=-1).indices, 1.0)
            n = probs.shape[0]
            f = chosen.sum(0) / (n * arch.num_experts_per_tok)
            layers.append(float(arch.num_experts * (f * probs.sum(0) / n).sum()))
        losses.append(sum(layers) / len(layers))
    return sum(losses) / len(losses)


def test_aux_loss_is_the_switch_loss_of_the_routers(tiny_moe, pool):
    """One sequence per rank in one micro-batch: the reported load-balancing loss equals the switch
    loss computed from transformers' router logits, averaged over layers and ranks."""
    out = pool.run(case_actor, str(tiny_moe), 1, 1, 1, n_trajectories=4, n_minibatches=1, aux_coef=0.5)
    trained = [ids for r in out for ids, _ in r["trained"]]
    assert sorted(trained) == [[0], [1], [2], [3]]
    want = _switch_loss(tiny_moe, _trajectories(4), trained)
    assert out[0]["stats"]["moe_aux_loss"] == pytest.approx(want, rel=1e-5)


def test_aux_loss_leaves_out_padding_only_microbatches(tiny_moe, pool):
    """Three sequences over four data-parallel ranks: the fourth rank trains a micro-batch of padding
    only (to stay in step with the others). It adds no load-balancing loss: the logged loss is the
    mean of the three real micro-batches' switch losses."""
    out = pool.run(case_actor, str(tiny_moe), 1, 1, 1, n_trajectories=3, n_minibatches=1, aux_coef=0.5)
    trained = [ids for r in out for ids, _ in r["trained"]]
    assert sorted(trained) == [[], [0], [1], [2]]
    want = _switch_loss(tiny_moe, _trajectories(3), [ids for ids in trained if ids])
    for r in out:
        assert r["stats"]["moe_aux_loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_aux_loss_leaves_out_sequence_parallel_padding(tiny_moe, pool, tp, pp):
    """TP2 with sequence parallelism pads each packed micro-batch to an even length; the padding
    tokens are not the policy's and must not count in the load-balancing loss (Megatron's
    ``padding_mask``; at PP2 the second stage gets its sequence-parallel slice of the mask): the
    loss is the switch loss of the micro-batches' real tokens."""
    out = pool.run(case_actor, str(tiny_moe), tp, pp, 1, n_trajectories=4, n_minibatches=1, aux_coef=0.5)
    trained = [mb for r in out if r["dp_head"] for mb in r["trained"]]
    padded = [ids for ids, n in trained if n > sum(len(_trajectories(4)[i].input_ids) for i in ids)]
    assert padded, f"no micro-batch was padded: {trained}"
    want = _switch_loss(tiny_moe, _trajectories(4), [ids for ids, _ in trained])
    for r in out:
        assert r["stats"]["moe_aux_loss"] == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------- routing replay (R3) and the routing mismatch


def case_routes(hf_dir: str, tp: int, pp: int, ep: int, routes: list[bytes]) -> dict:
    """Worker: logprobs with the given routes replayed; the mismatch measured without replay; then PPO
    updates without and with replay."""
    import dataclasses

    import torch.distributed as dist

    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.weights import load_hf_weights

    arch = load_arch(hf_dir)
    g = init_parallel(tp, pp, seed=3, backend="gloo", ep=ep)
    actor = Actor(arch, ModelConfig(max_seq_len=40, dtype="float32"),
                  ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1, max_tokens_per_mb=48),
                  OptimizerConfig(lr=1e-3, adam_eps=1e-4, distributed=True), PPOConfig(n_minibatches=2), g,
                  seed=3, total_steps=4)
    load_hf_weights(actor.model, hf_dir, arch, g.tp_rank, g.tp, optimizer=actor.optimizer, etp_rank=g.etp_rank,
                    etp_size=g.etp)
    trajs = [dataclasses.replace(t, routed_experts=r) for t, r in zip(_trajectories(len(routes)), routes)]
    seqs = [t.input_ids for t in trajs]
    rts = actor._rollout_routes(trajs)
    replayed = actor.compute_logprobs(seqs, routes=rts, route_hook=actor._route_hook(replay=True))
    hook = actor._route_hook(replay=False)
    free = actor.compute_logprobs(seqs, routes=rts, route_hook=hook)
    out = {"replayed": [x.tolist() for x in replayed], "free": [x.tolist() for x in free],
           "mismatch": hook.mismatch(dist.group.WORLD)}
    out["stats_off"] = actor.ppo_update(trajs)
    actor.ppo_cfg.routing_replay = True
    out["stats_on"] = actor.ppo_update(trajs)
    teardown_parallel()
    return out


def test_routing_replay_follows_the_rollout_routes(tiny_moe, pool):
    """Routes of a 'rollout' whose router weights differ slightly: replayed, the trainer's logprobs are
    transformers' with those routes forced; unreplayed, the mismatch is the fraction of differing
    token-layer expert sets between the two routers."""
    from tiny_moe import hf_logprobs_with_routes, hf_routes

    trajs = _trajectories(4)
    rollout = [hf_routes(tiny_moe, t.input_ids, router_noise=0.3, seed=i)[:-1] for i, t in enumerate(trajs)]
    own = [hf_routes(tiny_moe, t.input_ids)[:-1] for t in trajs]
    differing = sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in zip(rollout, own))
    total = sum(a.shape[0] * a.shape[1] for a in own)
    assert 0 < differing < total
    forced = [hf_logprobs_with_routes(tiny_moe, t.input_ids, torch.cat([r, o[-1:]]))
              for t, r, o in zip(trajs, rollout, [hf_routes(tiny_moe, t.input_ids) for t in trajs])]
    free = hf_logprobs(tiny_moe, [t.input_ids for t in trajs])
    assert max((a - b).abs().max().item() for a, b in zip(forced, free)) > 1e-3  # the routes matter
    routes = [r.to(torch.int32).contiguous().numpy().tobytes() for r in rollout]
    worst = {}
    for tp, pp, ep in ((1, 1, 2), (2, 1, 2)):
        for rank, got in enumerate(pool.run(case_routes, str(tiny_moe), tp, pp, ep, routes)):
            worst[tp, pp, ep] = max(_max_diff(got["replayed"], forced), _max_diff(got["free"], free))
            assert got["mismatch"] == pytest.approx(differing / total), (tp, ep, rank)
            assert got["stats_off"]["routing_mismatch"] == pytest.approx(differing / total)
            assert "routing_mismatch" not in got["stats_on"]
    print("max |logprob - transformers| with replayed / free routes:", worst)
    assert max(worst.values()) <= TOLERANCE, worst


def test_cli_refuses_expert_layouts_the_model_cannot_split_into(tiny_moe, tmp_path, capsys):
    from megatron_areal.convert.cli import main as convert_main
    from megatron_areal.convert.score import main as score_main

    assert convert_main(["hf-to-mcore", "--hf", str(tiny_moe), "--out", str(tmp_path / "c"), "--ep", "3"]) == 1
    assert "parallel.ep=3 must divide the model's num_experts=8" in capsys.readouterr().err
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text('{"input_ids": [1, 2, 3]}\n')
    assert score_main(["--hf", str(tiny_moe), "--input", str(seqs), "--output", str(tmp_path / "o.jsonl"),
                       "--ep", "2", "--etp", "3"]) == 1
    assert "parallel.etp=3 must divide the model's moe_intermediate_size=40" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- the pool stays light: groups per layout are bounded

# What Megatron-core's initialize_model_parallel creates per rank on a four-rank world (17 at TP2 x EP2: only 4
# distinct memberships, 5 of them single-rank; each gloo group keeps about three threads).
MAX_GROUPS_PER_LAYOUT = 17


def groups_across_layouts(layouts: list[tuple[int, int, int, int]]) -> dict:
    """Live process groups and threads of this rank: left over when called, and around each layout."""
    from megatron_areal.actor.parallel import init_parallel, live_process_groups, teardown_parallel

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    out = {"left_over": len(live_process_groups()), "rows": []}
    for tp, pp, ep, etp in layouts:
        before = threads()
        init_parallel(tp, pp, backend="gloo", ep=ep, etp=etp)
        created = len(live_process_groups())
        teardown_parallel()
        out["rows"].append({"created": created, "after": len(live_process_groups()),
                            "extra_threads": threads() - before})
    return out


def test_layouts_leave_no_process_groups_behind(pool):
    """Megatron's destroy_model_parallel only forgets its groups; the pool once held 511 gloo groups and 1,537
    threads per rank after this module's layouts. Placed last, this also sees what the module's tests left."""
    for rank, got in enumerate(pool.run(groups_across_layouts, [*LAYOUTS, *LAYOUTS])):
        assert got["left_over"] == 0, (rank, got)
        for row in got["rows"]:
            assert 0 < row["created"] <= MAX_GROUPS_PER_LAYOUT and row["after"] == 0, (rank, got)
        # the first layout also starts threads that live as long as the process (thread pools used once)
        assert all(row["extra_threads"] <= 0 for row in got["rows"][1:]), (rank, got)
