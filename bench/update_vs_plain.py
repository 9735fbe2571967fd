"""Learning per update: one update of the main job's actor against one ``grpo_step`` of the plain loop.

Both start from the same SmolLM2 weights and take one update on the same informative groups (8 samples
of a training prompt from the base model at the main job's temperature, rewards not all equal; on-policy),
in the compute dtype of ``--config`` as each runs it on this CPU: ours with the main job's actor, optimizer
and objective (bf16: bf16 weights, fp32 masters, stochastic rounding), the plain loop as
``bench/plain_grpo.py`` does (bf16: ``torch.autocast`` over fp32 weights, torch's ``AdamW``). After the
update each side's own model scores the group again: the improvement is ``sum_i A_i * dlogp_i``, the
advantage-weighted change of each sample's mean token logprob at the sampling temperature (what a
policy-gradient step raises). Each group starts from fresh weights on both sides.

Check before any RESULT: the two sides' logprobs of the groups agree before the update (the same model).
``RESULT update_gain_vs_plain R``: ours' mean improvement over the plain loop's mean improvement (a ratio of
means: in bf16 the plain loop's improvement of one group is near zero and of either sign, and a mean of
per-group ratios then swings from -30 to +30 on the same updates). The plain loop's mean must be positive,
or there is no ratio to report and the bench exits non-zero saying so. Both sides compute in fp32 unless
``model.dtype=bfloat16`` is given: fp32 is what the main job runs on a CPU without native bf16, and what a
user of the plain loop picks anywhere (its bf16 autocast rounds away steps of lr 1e-5, docs/benchmarks.md).

    python bench/update_vs_plain.py [--config configs/smollm2_arith.yaml] [--groups 4] [key=value ...]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plain_grpo  # noqa: E402
from results import Results  # noqa: E402

AGREEMENT = 0.05  # nats, mean absolute gap of the sides' token logprobs before the update (bf16 CPU kernels differ)


def informative_groups(model, tokenizer, cfg, n: int,
                       dtype: torch.dtype) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """``n`` groups of the training stream whose rewards are not all equal: (sequences, prompt width, rewards)."""
    from megatron_areal.data.stream import PromptStream
    from megatron_areal.data.tasks import load_task
    from megatron_areal.reward.arithmetic import verify_number

    stream = PromptStream(load_task(cfg.data.train, cfg.data.seed, cfg.data.train_size or None), seed=cfg.data.seed)
    groups = []
    while len(groups) < n:
        prompt = next(stream)
        with plain_grpo.autocast(dtype):
            out, prompt_mask = plain_grpo.generate(model, tokenizer, plain_grpo.encode(tokenizer, [prompt]),
                                                   n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                                                   temperature=cfg.rollout.temperature)
        texts = plain_grpo.replies(tokenizer, out, prompt_mask.shape[1])
        rewards = torch.tensor([verify_number(t, prompt.answer).reward for t in texts])
        if rewards.max() > rewards.min():
            groups.append((out, prompt_mask.shape[1], rewards))
    return groups


def improvement(before: list[torch.Tensor], after: list[torch.Tensor], rewards: torch.Tensor) -> float:
    """sum_i A_i * (mean logprob after - before) over the group, A the group-normalised reward."""
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    moves = torch.tensor([float(a.mean() - b.mean()) for b, a in zip(before, after, strict=True)])
    return float((adv * moves).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"))
    parser.add_argument("--groups", type=int, default=4, help="informative groups, each from fresh weights")
    parser.add_argument("override", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()

    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.config import load_config
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.assets import resolve_model
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.records import Trajectory
    from megatron_areal.util.compute_dtype import runnable_dtype

    cfg = load_config(str(args.config), ["model.dtype=float32", *args.override])  # a later override wins
    dtype = runnable_dtype(getattr(torch, "float32" if cfg.model.dtype == "auto" else cfg.model.dtype),
                           torch.device("cpu"), "model.dtype")
    temperature = cfg.rollout.temperature
    torch.manual_seed(cfg.train.seed)
    hf, tokenizer = plain_grpo.load(cfg.model.path, threads=2)
    eos = tokenizer.eos_token_id
    groups = informative_groups(hf, tokenizer, cfg, args.groups, dtype)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    parallel = init_parallel(1, 1, seed=cfg.train.seed, backend="gloo")
    hf_dir = resolve_model(cfg.model.path)
    arch = load_arch(hf_dir)
    results = Results("update_vs_plain")
    gains: dict[str, list[float]] = {"ours": [], "plain": []}
    print(f"compute dtype {str(dtype).removeprefix('torch.')}, lr {cfg.optimizer.lr:g}, temperature {temperature}")
    for k, (out, width, rewards) in enumerate(groups):
        seqs = plain_grpo.trained_sequences(out, width, eos)
        plain = copy.deepcopy(hf)
        optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.optimizer.lr, weight_decay=0.0)
        plain_before = [lp[width - 1:] for lp in plain_grpo.token_logprobs(plain, seqs, temperature, dtype)]
        plain_grpo.grpo_step(plain, optimizer, out, torch.ones(out.shape[0], width, dtype=torch.long), rewards,
                             cfg.rollout.group_size, eos, eps_clip=cfg.ppo.eps_clip, clip_grad=cfg.optimizer.clip_grad,
                             dtype=dtype)
        plain_after = [lp[width - 1:] for lp in plain_grpo.token_logprobs(plain, seqs, temperature, dtype)]
        plain_gain = improvement(plain_before, plain_after, rewards)
        del plain, optimizer

        actor = Actor(arch, cfg.model, cfg.parallel, cfg.optimizer, cfg.ppo, parallel, seed=cfg.train.seed,
                      total_steps=cfg.train.steps)
        load_hf_weights(actor.model, hf_dir, arch, 0, 1, optimizer=actor.optimizer)
        ours_before = [lp[width - 1:].float() for lp in actor.compute_logprobs(seqs, temperature)]
        gap = statistics.fmean(float((a - b).abs().mean()) for a, b in zip(ours_before, plain_before, strict=True))
        results.check(gap < AGREEMENT, f"group {k}: the sides' logprobs differ by {gap:.3f} nats before the update")
        trajs = [Trajectory(prompt_ids=s[:width], output_ids=s[width:], output_logprobs=lp.tolist(),
                            output_versions=[0] * (len(s) - width), reward=float(r))
                 for s, lp, r in zip(seqs, ours_before, rewards, strict=True)]
        actor.ppo_update(trajs, temperature, version=0)
        ours_after = [lp[width - 1:].float() for lp in actor.compute_logprobs(seqs, temperature)]
        ours_gain = improvement(ours_before, ours_after, rewards)
        del actor
        gains["ours"].append(ours_gain)
        gains["plain"].append(plain_gain)
        print(f"group {k} (rewards {rewards.tolist()}): improvement ours {ours_gain:+.4f}, plain {plain_gain:+.4f}, "
              f"logprob gap before {gap:.4f}", flush=True)
    teardown_parallel()
    ours, plain = statistics.fmean(gains["ours"]), statistics.fmean(gains["plain"])
    print(f"mean improvement over {len(groups)} groups: ours {ours:+.4f}, plain {plain:+.4f}")
    results.check(plain > 0, f"the plain loop's updates did not raise its groups' advantage-weighted logprobs "
                             f"(mean {plain:+.4f}): no ratio to report")
    results.add("update_gain_vs_plain", ours / plain if plain > 0 else float("nan"), digits=2)
    sys.exit(results.emit())


if __name__ == "__main__":
    main()
