"""Low-rank adapters (``model.lora``): trained at TP2, PP2 and DP2 alike, exported for the real ``peft``.

One two-rank gloo pool. A tiny Qwen3 (HF weights) gets rank-4 adapters on all seven projections and takes
two decoupled-PPO steps at three layouts (DP2, TP2, PP2), then saves a training checkpoint. References are
other people's code: ``peft.PeftModel.from_pretrained`` loads the ``--adapter-only`` export onto the HF base
model in transformers, and transformers runs the merged export. Checked in fp32:

- the trainer's logprobs after the steps equal PEFT's and the merged model's, at every layout, and
  ``score`` of the checkpoint at TP1 and TP2 equals them too;
- the three layouts train the same adapters (the TP/PP gradient paths are right);
- a weight push (``weights/gather.py``) sends the merged weights the export writes;
- a step changes only adapter parameters; the optimizer holds exactly the adapters; the base gets no
  gradient buffer;
- the checkpoint resumes at another layout: a third step after resuming equals one without stopping.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_checkpoint import random_batch
from test_score import model_logprobs

from megatron_areal.convert.spawn import WorkerPool

pytestmark = pytest.mark.timeout(900)

EVAL = [[3, 17, 40, 41, 42, 90, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 99, 98], [100, 2, 64]]
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on two ranks: DP2, TP2, PP2
TOLERANCE = 1e-4  # fp32 logprobs through different kernels (as tests/test_score.py)


def _actor(hf_dir: str, tp: int, pp: int, seed: int, lora: dict, recompute: bool = False):
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights

    arch = load_arch(hf_dir)
    groups = init_parallel(tp=tp, pp=pp, backend="gloo", seed=seed)
    actor = Actor(arch, ModelConfig(path=hf_dir, dtype="float32", max_seq_len=64, lora=LoraConfig(**lora),
                                    recompute_activations=recompute),
                  ParallelConfig(tp=tp, pp=pp), OptimizerConfig(lr=2e-2, adam_eps=1e-4, distributed=True), PPOConfig(),
                  groups, seed=seed, total_steps=10)
    load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
    return arch, groups, actor


def _named(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in actor.model for n, p in c.named_parameters()}


def train_and_save(hf_dir: str, root: str, tp: int, pp: int, lora: dict) -> dict:
    """Two steps, a checkpoint, a third step; what each rank saw."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, tp, pp, seed=1, lora=lora)
    start = _named(actor)
    base_lp = actor.compute_logprobs(EVAL)
    actor.ppo_update(random_batch(1))
    actor.ppo_update(random_batch(2))
    end = _named(actor)
    optimized = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    params = [(n, p) for c in actor.model for n, p in c.named_parameters()]
    path = Checkpointer(root, arch, groups, keep=1, hf_dir=hf_dir).save(2, actor.model, actor.optimizer,
                                                                          actor.scheduler)
    trained_lp = actor.compute_logprobs(EVAL)
    from megatron_areal.weights.gather import stage_hf_tensors

    pushed = {n: t.clone() for n, t in stage_hf_tensors(actor.model, arch, groups)}  # what a weight push sends
    actor.ppo_update(random_batch(3))
    out = {"base": [x.tolist() for x in base_lp], "trained": [x.tolist() for x in trained_lp],
           "continued": [x.tolist() for x in actor.compute_logprobs(EVAL)], "ckpt": str(path),
           "changed": sorted(n for n in start if not torch.equal(start[n], end[n])),
           "unchanged": sorted(n for n in start if torch.equal(start[n], end[n])),
           "with_grad_buffer": sorted(n for n, p in params if hasattr(p, "main_grad")),
           "optimized": optimized, "adapter_numel": sum(p.numel() for n, p in params if ".lora." in n),
           "dp_rank": groups.dp_rank, "dp": groups.dp, "pushed": pushed}
    teardown_parallel()
    return out


def resume(hf_dir: str, ckpt: str, tp: int, pp: int, lora: dict) -> dict:
    """Resume at another layout from differently seeded adapters, then take the third step."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, tp, pp, seed=7, lora=lora)
    Checkpointer(ckpt + "-unused", arch, groups).load(ckpt, actor.model, actor.optimizer, actor.scheduler)
    loaded = actor.compute_logprobs(EVAL)
    actor.ppo_update(random_batch(3))
    out = {"loaded": [x.tolist() for x in loaded], "continued": [x.tolist() for x in actor.compute_logprobs(EVAL)]}
    teardown_parallel()
    return out


def resume_without_adapters(hf_dir: str, ckpt: str) -> str:
    """The error of resuming a LoRA checkpoint in a run without adapters."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, 1, 1, seed=7, lora={**LORA, "rank": 0})
    try:
        Checkpointer(ckpt + "-unused", arch, groups).load(ckpt, actor.model, actor.optimizer, actor.scheduler)
    except Exception as e:  # the test reads the message
        return f"{type(e).__name__}: {e}"
    finally:
        teardown_parallel()
    return "no error"


def tp_replicas_with_dropout(hf_dir: str) -> dict:
    """At TP2 with adapter dropout, the whole (unsplit) matrices stay equal on both TP ranks."""
    from megatron_areal.actor.parallel import teardown_parallel

    _, _, actor = _actor(hf_dir, 2, 1, seed=1, lora={**LORA, "dropout": 0.3})
    actor.ppo_update(random_batch(1))
    actor.ppo_update(random_batch(2))
    whole = {}
    for c in actor.model:
        for name, pair in c.module.lora.layers.items():
            for target, p in pair.items():
                matrix = "B" if p.split == "A" else "A"
                whole[f"{name}.{target}.{matrix}"] = getattr(p, matrix).detach().tolist()
    teardown_parallel()
    return whole


def trained_with_recompute(hf_dir: str) -> list[list[float]]:
    """The TP2 run's two steps with activation recomputation (each layer's forward, hooks included, runs twice)."""
    from megatron_areal.actor.parallel import teardown_parallel

    _, _, actor = _actor(hf_dir, 2, 1, seed=1, lora=LORA, recompute=True)
    actor.ppo_update(random_batch(1))
    actor.ppo_update(random_batch(2))
    out = [x.tolist() for x in actor.compute_logprobs(EVAL)]
    teardown_parallel()
    return out


def _diff(a, b) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    with WorkerPool(2, timeout_s=800) as pool:
        out = {layout: pool.run(train_and_save, str(tiny_qwen3), str(root / f"tp{layout[0]}pp{layout[1]}"),
                                *layout, LORA) for layout in LAYOUTS}
        tp2_ckpt = out[(2, 1)][0]["ckpt"]
        out["resumed"] = pool.run(resume, str(tiny_qwen3), tp2_ckpt, 1, 2, LORA)
        out["no_adapters"] = pool.run(resume_without_adapters, str(tiny_qwen3), tp2_ckpt)
        out["dropout"] = pool.run(tp_replicas_with_dropout, str(tiny_qwen3))
        out["recompute"] = pool.run(trained_with_recompute, str(tiny_qwen3))
        from megatron_areal.convert.score import score

        out["score"] = {tp: score("ckpt", tp2_ckpt, EVAL, tp=tp, pool=pool) for tp in (1, 2)}
    yield root, out


def test_peft_loads_the_adapter_export_with_the_trainers_logits(runs, tiny_qwen3, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_areal.convert.cli import main as convert_main

    _, out = runs
    adapters = {}
    for tp, pp in LAYOUTS:
        ranks = out[(tp, pp)]
        ckpt = ranks[0]["ckpt"]
        peft_dir, merged_dir = tmp_path / f"peft{tp}{pp}", tmp_path / f"merged{tp}{pp}"
        assert convert_main(["mcore-to-hf", "--ckpt", ckpt, "--out", str(peft_dir), "--adapter-only"]) == 0
        assert convert_main(["mcore-to-hf", "--ckpt", ckpt, "--out", str(merged_dir)]) == 0
        assert json.loads((peft_dir / "adapter_config.json").read_text())["r"] == LORA["rank"]
        tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
        assert "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" in tensors
        assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in tensors
        adapters[(tp, pp)] = tensors

        base = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
        base_lp = model_logprobs(base, EVAL)
        peft_model = PeftModel.from_pretrained(base, str(peft_dir)).eval()
        peft_lp = model_logprobs(peft_model, EVAL)
        merged_lp = model_logprobs(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval(), EVAL)

        assert _diff(ranks[0]["base"], base_lp) <= TOLERANCE, (tp, pp)  # B = 0: the adapted model starts as the base
        assert _diff(peft_lp, base_lp) > 1e-2, "the adapters are trained: PEFT's model differs from the base"
        assert _diff(ranks[0]["trained"], peft_lp) <= TOLERANCE, (tp, pp)
        assert _diff(merged_lp, peft_lp) <= TOLERANCE, (tp, pp)
        assert _diff(ranks[1]["trained"], ranks[0]["trained"]) == 0.0  # every rank returns the same
        pushed = {n: t for r in ranks for n, t in r["pushed"].items()}  # each pipeline stage's head sends its own
        merged_tensors = load_file(str(merged_dir / "model.safetensors"))
        assert sorted(pushed) == sorted(merged_tensors), (tp, pp)
        worst = max(float((pushed[n] - merged_tensors[n]).abs().max()) for n in pushed)
        assert worst <= 1e-6, (tp, pp, worst)  # the push sends the merged weights
    for layout in LAYOUTS[1:]:  # TP2 and PP2 train the adapters DP2 trains
        worst = max(float((t - adapters[LAYOUTS[0]][name]).abs().max()) for name, t in adapters[layout].items())
        assert worst <= 1e-5, (layout, worst)
    for tp, got in out["score"].items():  # megatron-areal score of the TP2 checkpoint, at TP1 and TP2
        assert _diff(got, out[(2, 1)][0]["trained"]) <= TOLERANCE, tp


def test_a_step_changes_only_the_adapters_and_the_optimizer_holds_only_them(runs):
    _, out = runs
    for layout in LAYOUTS:
        for rank in out[layout]:
            assert rank["changed"] and all(".lora." in n for n in rank["changed"]), (layout, rank["changed"])
            assert not [n for n in rank["unchanged"] if ".lora." not in n and n.endswith(".B")]
            assert all(".lora." in n for n in rank["with_grad_buffer"]), layout
            assert rank["adapter_numel"] > 0
        # the distributed optimizer shards its parameters over the DP ranks: together they are the adapters
        if out[layout][0]["dp"] == 2:
            assert sum(r["optimized"] for r in out[layout]) == out[layout][0]["adapter_numel"]
        else:
            assert all(r["optimized"] == r["adapter_numel"] for r in out[layout])


def test_resume_at_another_layout_continues_the_run(runs):
    _, out = runs
    tp2 = out[(2, 1)][0]
    for rank in out["resumed"]:  # saved at TP2, resumed at PP2 from other random adapters
        assert _diff(rank["loaded"], tp2["trained"]) <= 1e-5
        assert _diff(rank["continued"], tp2["continued"]) <= 1e-5
        assert _diff(rank["continued"], rank["loaded"]) > 1e-3  # the third step moved the policy
    for message in out["no_adapters"]:
        assert message.startswith("CheckpointMismatchError") and "saved with model.lora" in message, message
        assert "this run has off" in message, message


def test_dropout_keeps_tensor_parallel_replicas_equal(runs):
    _, out = runs
    first, second = out["dropout"]
    assert first.keys() == second.keys() and first
    for name in first:
        assert first[name] == second[name], name


@pytest.mark.parametrize(("overrides", "key"), [
    (["model.lora.rank=4", "model.lora.targets=[qkv_proj]"], "model.lora.targets"),
    (["model.lora.rank=-1"], "model.lora.rank"),
    (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout"),
    (["model.lora.rank=4", "model.lora.targets=[q_proj, q_proj]"], "model.lora.targets"),
    (["model.lora.rank=4", "weights.verify=true"], "weights.verify"),
    (["model.lora.rank=4", "weights.transfer=shards"], "weights.transfer"),
])
def test_bad_lora_settings_are_refused_naming_the_key(overrides, key):
    from megatron_areal.config import load_config
    from megatron_areal.configbase import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
    load_config(None, ["model.lora.rank=4", "model.lora.targets=[q_proj, v_proj]"])  # a good one loads


def test_moe_experts_are_refused():
    import tempfile

    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.lora_sites import check_targets
    from tests.tiny_moe import make_tiny_qwen3_moe

    with tempfile.TemporaryDirectory() as d:
        arch = load_arch(make_tiny_qwen3_moe(d))
    check_targets(arch, ["q_proj", "o_proj"])  # attention of a MoE model has adapter sites
    with pytest.raises(ValueError, match="model.lora.targets: 'gate_proj': qwen3_moe is a mixture-of-experts"):
        check_targets(arch, ["q_proj", "gate_proj"])


def test_activation_recomputation_trains_the_same_adapters(runs):
    _, out = runs
    for rank in out["recompute"]:
        assert _diff(rank, out[(2, 1)][0]["trained"]) <= 1e-5


def test_a_lora_run_pushes_through_the_stage_heads():
    from megatron_areal.weights.push import transfer_of

    assert transfer_of("auto", "embedded", adapters=True) == "stage_heads"  # the path that merges
    assert transfer_of("auto", "vllm", adapters=True) == "stage_heads"
    assert transfer_of("auto", "embedded") == "shards"
    with pytest.raises(ValueError, match="model.lora"):
        transfer_of("shards", "embedded", adapters=True)
