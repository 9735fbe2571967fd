"""Routing replay (R3) end to end: the embedded server samples a tiny Qwen3-MoE and returns the
experts it routed each token to; the trainer, holding the same weights, replays them through
``ppo.routing_replay`` in its proximal and training forwards.

Replayed, the trainer's logprobs on the sampled tokens are the server's to float32 rounding.
Without replay the trainer reports ``routing_mismatch``: 0 on identical fp32 weights, and above
0 when its router weights differ slightly from the server's (near-tied router scores then pick
other experts), where replay narrows the logprob gap.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_moe import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe, sample_with_routes

from megatron_areal.configbase import ConfigError

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5], [10, 20, 30, 40, 50, 60, 70], [2, 9], [8, 8, 8, 1], [6, 5, 4, 3, 2]]
NEW_TOKENS = 12


def test_replay_requires_the_rollout_routes() -> None:
    from megatron_areal.config import load_config

    with pytest.raises(ConfigError, match=r"^ppo\.routing_replay: .*rollout\.return_routed_experts"):
        load_config(None, ["ppo.routing_replay=true"])
    cfg = load_config(None, ["ppo.routing_replay=true", "rollout.return_routed_experts=true"])
    assert cfg.ppo.routing_replay and cfg.rollout.return_routed_experts


def perturb_routers(src, dst, scale: float, seed: int = 0):
    """A copy of the HF checkpoint ``src`` whose router weights carry Gaussian noise of std ``scale``."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensors[name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def _train_run(server_dir: str, trainer_dirs: dict[str, str]) -> dict:
    """Worker: sample with routes on ``server_dir``; for each trainer checkpoint and replay off/on,
    the trainer's logprobs on the sampled tokens and one decoupled-PPO update's statistics."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights

    trajs = sample_with_routes(server_dir, PROMPTS, NEW_TOKENS)
    arch = load_arch(server_dir)
    out: dict = {"n_tokens": sum(len(t.output_ids) for t in trajs)}
    for name, hf_dir in trainer_dirs.items():
        for replay in (False, True):
            groups = init_parallel(1, 1, seed=1, backend="gloo")
            actor = Actor(arch, ModelConfig(path=hf_dir, dtype="float32", max_seq_len=64), ParallelConfig(),
                          OptimizerConfig(lr=1e-3), PPOConfig(n_minibatches=2, routing_replay=replay), groups,
                          seed=1, total_steps=2)
            load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
            routes = actor._rollout_routes(trajs)
            lps = actor.compute_logprobs([t.input_ids for t in trajs], routes=routes,
                                         route_hook=actor._route_hook(replay=replay))
            gap = [(lp[-len(t.output_ids):] - torch.tensor(t.output_logprobs)).abs() for lp, t in zip(lps, trajs)]
            res = {"max_gap": float(torch.cat(gap).max()), "mean_gap": float(torch.cat(gap).mean())}
            if replay:
                stripped = [*trajs[:3], type(trajs[3])(**{**trajs[3].__dict__, "routed_experts": None}), *trajs[4:]]
                try:
                    actor.ppo_update(stripped, version=0)
                except ValueError as e:
                    res["missing_error"] = str(e)
            res["stats"] = actor.ppo_update(trajs, version=0)
            out[name, replay] = res
            teardown_parallel()
    return out


def test_replayed_trainer_logprobs_match_the_server(tmp_path) -> None:
    from megatron_areal.convert.spawn import WorkerPool

    server = make_tiny_qwen3_moe(tmp_path / "moe", seed=0)
    # near-tied router scores (router std 0.05 instead of 1) and a trainer whose routers are 1e-3 off
    tied = make_tiny_qwen3_moe(tmp_path / "moe_tied", seed=0, router_std=0.05)
    near = perturb_routers(tied, tmp_path / "moe_near", scale=1e-3)
    with WorkerPool(1, timeout_s=300) as pool:
        out = pool.run(_train_run, str(server), {"same": str(server)})[0]
        out.update(pool.run(_train_run, str(tied), {"near": str(near)})[0])
    for key, r in out.items():
        if key != "n_tokens":
            print(key, {k: v for k, v in r.items() if k != "stats"},
                  {k: r["stats"][k] for k in ("routing_mismatch", "rollout_mismatch_abs") if k in r["stats"]})
    n = out["n_tokens"]
    assert n == len(PROMPTS) * NEW_TOKENS
    # identical weights: replayed, the trainer's logprobs are the server's (proximal forward, training forward)
    on = out["same", True]
    assert on["max_gap"] < 1e-5
    assert on["stats"]["rollout_mismatch_tokens"] == n and on["stats"]["rollout_mismatch_abs"] < 1e-5
    assert abs(on["stats"]["behav_imp_weight_max"] - 1) < 1e-5
    assert "routing_mismatch" not in on["stats"]  # measured only where the trainer routes on its own
    assert on["missing_error"].startswith("ppo.routing_replay: trajectory 3 has no routed_experts")
    # without replay, on identical fp32 weights the routes agree: the mismatch is reported, and 0
    off = out["same", False]
    assert off["stats"]["routing_mismatch"] == 0.0 and off["max_gap"] < 1e-5
    # router weights a little off the server's: near-tied scores pick other experts without replay;
    # replaying the server's routes shrinks the logprob gap
    near_off, near_on = out["near", False], out["near", True]
    assert 0 < near_off["stats"]["routing_mismatch"] < 0.5
    assert near_on["mean_gap"] < near_off["mean_gap"] / 2


@pytest.mark.parametrize("make", [make_tiny_mixtral, make_tiny_qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_replay_on_the_other_moe_families(make, tmp_path) -> None:
    """Mixtral and Qwen2-MoE (shared expert beside the replayed routed ones): the server's routes reach
    the trainer's routers, and on the same fp32 weights the replayed logprobs are the server's."""
    from megatron_areal.convert.spawn import WorkerPool

    server = make(tmp_path / "moe", seed=0)
    with WorkerPool(1, timeout_s=300) as pool:
        out = pool.run(_train_run, str(server), {"same": str(server)})[0]
    on, off = out["same", True], out["same", False]
    assert on["max_gap"] < 1e-5 and on["stats"]["rollout_mismatch_tokens"] == out["n_tokens"]
    assert off["stats"]["routing_mismatch"] == 0.0 and off["max_gap"] < 1e-5
