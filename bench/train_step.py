"""Training step time: packed (padding-free THD) vs padded micro-batches, side by side.

One process (gloo, CPU), one model, the same long-tailed set of sequences. Each variant runs the
same work per step: forward and backward of the decoupled-PPO loss over all micro-batches through
Megatron's schedule, then one optimizer step.

- packed: micro-batches allocated under the token budget (FFD count, balanced spread), each a
  single row of concatenated sequences with per-sequence causal attention and positions;
- padded: ``budget // max_len`` sequences per micro-batch in arrival order, right-padded to the
  longest sequence of the micro-batch (the usual fixed-batch-size baseline; that batch size is
  the largest whose worst case fits the same token budget, so both have the same peak memory).

Token utilisation is real tokens / token slots computed (packed: micro-batches x budget; padded:
micro-batches x batch x longest). Step times are medians over interleaved repeats.

    python bench/train_step.py [--sequences 320] [--budget 2048] [--max-len 512] [--repeats 3]
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time

import torch


def long_tail(n: int, max_len: int, seed: int) -> list[int]:
    """Pareto-distributed lengths (most short, a few at max_len), as RL responses are."""
    rng = random.Random(seed)
    return [max(8, min(int(rng.paretovariate(1.1) * 25), max_len)) for _ in range(n)]


def ppo_loss(mask: torch.Tensor, logprobs: torch.Tensor, n_tokens: float) -> tuple[torch.Tensor, dict]:
    from megatron_areal.algorithm import decoupled_ppo_loss

    old = logprobs.detach()
    advantages = torch.where(mask, torch.ones_like(old), torch.zeros_like(old))
    loss, _ = decoupled_ppo_loss(logprobs, old, old, advantages, mask, loss_scale_tokens=n_tokens)
    return loss, {}


def packed_step(model, groups, seqs, budget, vocab) -> int:
    from megatron_areal.actor.engine import run_microbatches
    from megatron_areal.actor.microbatch import pack
    from megatron_areal.data.packing import allocate_microbatches

    plan = allocate_microbatches([len(s) for s in seqs], budget)[0]
    batches = [pack(seqs, ids) for ids in plan]
    n = float(sum(len(s) - 1 for s in seqs))
    run_microbatches(model, batches, groups, vocab_size=vocab, temperature=1.0, forward_only=False,
                     loss_fn=lambda mb, lp, ent: ppo_loss(mb.target_mask, lp, n))
    return len(batches) * budget


def padded_step(model, groups, seqs, batch_size, vocab) -> int:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_areal.actor.logprobs import vocab_parallel_logprobs

    groups_of = [seqs[i:i + batch_size] for i in range(0, len(seqs), batch_size)]
    n = float(sum(len(s) - 1 for s in seqs))
    slots = 0
    batches = []
    for group in groups_of:
        width = max(len(s) for s in group)
        slots += width * len(group)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for r, s in enumerate(group):
            tokens[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s) - 1] = True
        targets = torch.cat([tokens[:, 1:], torch.zeros(len(group), 1, dtype=torch.long)], dim=1)
        batches.append((tokens, targets, mask))

    def loss_fn(targets, mask, logits):
        lp, _ = vocab_parallel_logprobs(logits, targets, tp_group=groups.tp_group, tp_rank=0, vocab_size=vocab)
        return ppo_loss(mask, lp, n)

    def forward_step(it, chunk):
        tokens, targets, mask = next(it)
        positions = torch.arange(tokens.size(1)).expand_as(tokens)
        return chunk(tokens, positions, None), functools.partial(loss_fn, targets, mask)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                                num_microbatches=len(batches), seq_length=max(b[0].size(1) for b in batches),
                                micro_batch_size=batch_size, forward_only=False)
    return slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=320)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)

    from megatron_areal.actor.config import OptimizerConfig
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.optim import build_train_state
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.convert.arch import ModelArch

    vocab = 2048
    arch = ModelArch(model_type="qwen2", vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
                     max_position_embeddings=args.max_len, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                     qkv_bias=True, qk_norm=False, tie_word_embeddings=True)
    groups = init_parallel(1, 1, seed=args.seed, backend="gloo")
    state = build_train_state(build_model(arch, seed=args.seed), OptimizerConfig(lr=1e-5), groups, total_steps=100)
    rng = random.Random(args.seed)
    lengths = long_tail(args.sequences, args.max_len, args.seed)
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    real = sum(lengths)
    batch_size = max(args.budget // args.max_len, 1)
    print(f"{len(seqs)} sequences, {real} tokens, lengths min/median/max {min(lengths)}/"
          f"{int(statistics.median(lengths))}/{max(lengths)}; budget {args.budget}; padded batch {batch_size}; "
          f"model hidden {args.hidden} x {args.layers} layers")

    variants = {"packed": lambda: packed_step(state.model, groups, seqs, args.budget, vocab),
                "padded": lambda: padded_step(state.model, groups, seqs, batch_size, vocab)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    slots: dict[str, int] = {}
    for rep in range(args.repeats + 1):  # the first round warms up allocators and caches
        for name, step in variants.items():
            for chunk in state.model:
                chunk.zero_grad_buffer()
            state.optimizer.zero_grad()
            start = time.perf_counter()
            slots[name] = step()
            state.optimizer.step()
            if rep:
                times[name].append(time.perf_counter() - start)
    for name in variants:
        print(f"{name:7s} token utilisation {real / slots[name]:6.1%}  step time median "
              f"{statistics.median(times[name]):7.3f} s  ({', '.join(f'{t:.3f}' for t in times[name])})")
    ratio = statistics.median(times["padded"]) / statistics.median(times["packed"])
    print(f"padded/packed step-time ratio {ratio:.2f}x")
    print(f"RESULT packing_speedup {ratio:.3f}")


if __name__ == "__main__":
    main()
