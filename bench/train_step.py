"""Training step time: packed (padding-free THD) vs padded micro-batches, side by side.

One process (gloo, CPU), one model, the same long-tailed set of sequences. Each variant runs the
same work per step: forward and backward of the decoupled-PPO loss over all micro-batches through
Megatron's schedule, then one optimizer step.

- packed: micro-batches allocated under the token budget (FFD count, balanced spread), each a
  single row of concatenated sequences with per-sequence causal attention and positions;
- padded: ``budget // max_len`` sequences per micro-batch in arrival order, right-padded to the
  longest sequence of the micro-batch (the usual fixed-batch-size baseline; that batch size is
  the largest whose worst case fits the same token budget, so both have the same peak memory);
- sorted: the same padded batches after sorting the sequences by length (the better padded
  baseline: neighbours have similar lengths, so little padding).

Then the reference users compare against: one PPO step of our ``Actor`` on SmolLM2-135M against a
plain transformers loop on the same sequences (groups of 8 samples sharing a prompt, as in the main
job; ours lays each group's prompt out once, ``parallel.share_prompts``, and is also timed with
it off) (``AutoModelForCausalLM``, right-padded micro-batches
under the same token budget, the same ``decoupled_ppo_loss``, backward, gradient clipping,
``torch.optim.AdamW``), same compute dtype and threads, repeats interleaved so background load hits
both alike. Our actor steps with the main job's optimizer (in bf16: Megatron's precision-aware
distributed optimizer, bf16 gradients and moments, remainders for the fp32 masters, stochastic
rounding); transformers' AdamW keeps bf16 weights, gradients and moments. Before timing, our
logprobs are checked against fp32 transformers on the same tokens (in bf16: no further from them
than transformers' own bf16 forward, with 1.5x slack); a mismatch beyond that exits non-zero
without any RESULT (``bench/results.py``: the RESULT lines are printed at the end, once every check
passed). The last line is ``RESULT train_vs_hf <ours tokens/s / transformers tokens/s>``.

Token utilisation is real tokens / token slots computed (packed: micro-batches x budget; padded:
micro-batches x batch x longest). Step times are medians over interleaved repeats.

    python bench/train_step.py [--sequences 320] [--budget 2048] [--max-len 512] [--repeats 3]
                               [--hf-sequences 48] [--hf-budget 1024] [--dtype bfloat16] [--threads 2]
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import threading
import time

import torch
from results import Results


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
    ap.add_argument("--hf-sequences", type=int, default=48,
                    help="sequences of the SmolLM2 step (6 groups of 8; the main job trains 3 a step now)")
    ap.add_argument("--hf-budget", type=int, default=768, help="tokens per micro-batch (smollm2_arith.yaml)")
    ap.add_argument("--hf-repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-packing", action="store_true", help="only the transformers comparison")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)

    from transformers import AutoModelForCausalLM

    from megatron_areal.actor.model import resolve_dtype
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.assets import smollm2_path

    # Load the reference before init_parallel: transformers loaded after the CPU patch of
    # megatron-core (patches/cpu_gloo.py) gave NaN logits.
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=dtype)
    # the correctness reference: fp32 transformers (for a bf16 run, both sides are held to bf16's own error)
    fp32 = hf if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    groups = init_parallel(1, 1, seed=args.seed, backend="gloo")
    results = Results("train_step")
    if not args.skip_packing:
        packing_bench(args, groups, results)
    versus_transformers(args, groups, hf, fp32.eval(), results)
    sys.exit(results.emit())


def packing_bench(args, groups, results: Results) -> None:
    from megatron_areal.actor.config import OptimizerConfig
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.optim import build_train_state
    from megatron_areal.model.arch import ModelArch

    vocab = 2048
    arch = ModelArch(model_type="qwen2", vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
                     max_position_embeddings=args.max_len, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                     qkv_bias=True, qk_norm=False, tie_word_embeddings=True)
    chunks = build_model(arch, groups, seed=args.seed)
    state = build_train_state(chunks, OptimizerConfig(lr=1e-5), groups, total_steps=100)
    rng = random.Random(args.seed)
    lengths = long_tail(args.sequences, args.max_len, args.seed)
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    real = sum(lengths)
    batch_size = max(args.budget // args.max_len, 1)
    print(f"{len(seqs)} sequences, {real} tokens, lengths min/median/max {min(lengths)}/"
          f"{int(statistics.median(lengths))}/{max(lengths)}; budget {args.budget}; padded batch {batch_size}; "
          f"model hidden {args.hidden} x {args.layers} layers")

    variants = {"packed": lambda: packed_step(state.model, groups, seqs, args.budget, vocab),
                "padded": lambda: padded_step(state.model, groups, seqs, batch_size, vocab),
                "sorted": lambda: padded_step(state.model, groups, sorted(seqs, key=len, reverse=True), batch_size,
                                              vocab)}
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
    ratio_sorted = statistics.median(times["sorted"]) / statistics.median(times["packed"])
    print(f"padded/packed step-time ratio {ratio:.2f}x; length-sorted padded/packed {ratio_sorted:.2f}x")
    results.add("packing_speedup", ratio)
    results.add("packing_speedup_vs_sorted", ratio_sorted)


class PeakRSS:
    """Peak resident memory of this process while a block runs (sampled every 5 ms)."""

    def __init__(self) -> None:
        import psutil

        self.proc, self.peak, self.running = psutil.Process(), 0, False

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self.base = self.proc.memory_info().rss
        self.peak, self.running = self.base, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()


def rl_batch(n: int, seed: int):
    """Main-job-shaped trajectories: groups of 8 samples of one prompt of 40-60 tokens, answers of 8-48.
    Every prompt begins with the same 26 tokens, as the main job's chat template gives them a common
    system header."""
    from megatron_areal.records import Trajectory

    rng = random.Random(seed)
    header = [rng.randrange(1000, 40000) for _ in range(26)]
    out = []
    for i in range(n):
        if i % 8 == 0:
            prompt = header + [rng.randrange(1000, 40000) for _ in range(rng.randint(14, 34))]
        output = [rng.randrange(1000, 40000) for _ in range(rng.randint(8, 48))]
        out.append(Trajectory(prompt_ids=prompt, output_ids=output, group_id=i // 8,
                              output_logprobs=[-1.0 - rng.random() for _ in output], reward=float(rng.random() < 0.5)))
    return out


def hf_microbatches(trajectories, budget: int) -> list[list[int]]:
    """Arrival-order micro-batches whose padded size (rows x longest) stays within ``budget``."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i, t in enumerate(trajectories):
        n = len(t.input_ids)
        width = max([n] + [len(trajectories[j].input_ids) for j in current])
        if current and width * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def hf_logprobs(model, trajectories, ids: list[int]):
    """Per-position logprobs [rows, width - 1] (fp32) and the padded inputs of micro-batch ``ids``."""
    seqs = [trajectories[i].input_ids for i in ids]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = torch.tensor(s)
        attention[r, :len(s)] = 1
    logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return lp, seqs, width


def hf_step(model, optimizer, trajectories, budget: int, advantages: list[float]) -> None:
    """One PPO step the way a plain transformers loop does it (single mini-batch, pi_prox = pi_theta)."""
    from megatron_areal.algorithm import decoupled_ppo_loss

    n_loss = float(sum(sum(t.loss_mask) for t in trajectories))
    optimizer.zero_grad(set_to_none=True)
    for ids in hf_microbatches(trajectories, budget):
        lp, seqs, width = hf_logprobs(model, trajectories, ids)
        mask = torch.zeros(len(ids), width - 1)
        behaviour = torch.zeros(len(ids), width - 1)
        adv = torch.zeros(len(ids), width - 1)
        for r, i in enumerate(ids):
            t = trajectories[i]
            n = len(t.input_ids) - 1
            mask[r, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            behaviour[r, :n] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
            adv[r, :n] = mask[r, :n] * advantages[i]
        loss, _ = decoupled_ppo_loss(lp, lp.detach(), behaviour, adv, mask > 0, eps_clip=0.2,
                                     behav_imp_weight_cap=5.0, loss_scale_tokens=n_loss)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def state_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def versus_transformers(args, groups, hf, fp32, results: Results) -> None:
    """Our Actor against plain transformers (``hf``) on SmolLM2-135M; times the step only once our logprobs
    passed the check against fp32 transformers."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.ppo_batch import sequence_advantages
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.assets import smollm2_path
    from megatron_areal.model.weights import load_hf_weights

    hf_dir = smollm2_path()
    arch = load_arch(hf_dir)
    # the main job's optimizer (configs/smollm2_arith.yaml): precision-aware, bf16 gradients and moments
    lean = dict(precision_aware=True, main_grads_dtype="bfloat16", exp_avg_dtype="bfloat16",
                exp_avg_sq_dtype="bfloat16", bf16_rounding="stochastic") if args.dtype == "bfloat16" else {}
    actor = Actor(arch, ModelConfig(dtype=args.dtype, max_seq_len=256),
                  ParallelConfig(max_tokens_per_mb=args.hf_budget), OptimizerConfig(lr=1e-5, clip_grad=1.0, **lean),
                  PPOConfig(eps_clip=0.2, behav_imp_weight_cap=5.0, n_minibatches=1, advantage="grpo"), groups,
                  seed=args.seed, total_steps=100)
    load_hf_weights(actor.model, hf_dir, arch, 0, 1, optimizer=actor.optimizer)
    dtype = actor.dtype  # what our actor computes in (bf16 falls back to fp32 on CPUs without bf16 units)
    if not results.check(hf.dtype == dtype, f"reference dtype {hf.dtype} != ours {dtype}"):
        return
    hf.train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    print(f"SmolLM2-135M: model.dtype={args.dtype} -> both sides compute in {str(dtype).replace('torch.', '')}; "
          f"{torch.get_num_threads()} threads")

    # correctness: our logprobs against fp32 transformers on the same tokens, before any update. In
    # bf16 both implementations are off fp32 by bf16's rounding (mean ~0.07 nats on these random-token
    # sequences), so ours must on average be no further from fp32 than transformers' own bf16 forward.
    # The max is shown, not gated: at the attention-sink positions (hidden values near 25,000, where
    # bf16's step is 128) single tokens of either side move by nats (measured: ours 3.6, theirs 1.3).
    check = rl_batch(min(args.hf_sequences, 16), args.seed + 1)
    ours = actor.compute_logprobs([t.input_ids for t in check])
    with torch.no_grad():
        hf.eval()
        ref, _, _ = hf_logprobs(fp32, check, list(range(len(check))))
        theirs, _, _ = hf_logprobs(hf, check, list(range(len(check))))
        hf.train()

    def error(lp) -> torch.Tensor:
        return torch.cat([(lp[r][:len(o)].float() - ref[r, :len(o)]).abs() for r, o in enumerate(ours)])

    mine, base = error(ours), error(theirs)
    tol_max, tol_mean = (0.05, 0.005) if dtype == torch.float32 else (float("inf"), 1.5 * float(base.mean()) + 1e-3)
    print(f"logprobs against fp32 transformers: ours max |diff| {mine.max():.2e}, mean {mine.mean():.2e}; "
          f"transformers in {str(dtype).replace('torch.', '')}: max {base.max():.2e}, mean {base.mean():.2e} "
          f"(tolerance {tol_max:.3g} / {tol_mean:.3g})")
    if not results.check(bool(mine.max() <= tol_max and mine.mean() <= tol_mean),
                         f"our logprobs differ from fp32 transformers' beyond the tolerance (max {mine.max():.2e}, "
                         f"mean {mine.mean():.2e}; tolerance {tol_max:.3g} / {tol_mean:.3g})"):
        return

    batch = rl_batch(args.hf_sequences, args.seed)
    tokens = sum(len(t.input_ids) for t in batch)
    advantages = sequence_advantages(batch, "grpo")
    print(f"{len(batch)} sequences, {tokens} tokens (loss tokens {sum(len(t.output_ids) for t in batch)}), "
          f"micro-batch budget {args.hf_budget}: ours {len(actor._plan([t.input_ids for t in batch], 1))} packed, "
          f"transformers {len(hf_microbatches(batch, args.hf_budget))} padded")

    def ours(share: bool) -> None:
        actor.parallel_cfg.share_prompts = share
        actor.ppo_update(batch)

    sides = {"ours": lambda: ours(True), "ours-unshared": lambda: ours(False),
             "transformers": lambda: hf_step(hf, hf_opt, batch, args.hf_budget, advantages)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    peaks: dict[str, int] = dict.fromkeys(sides, 0)
    for rep in range(args.hf_repeats + 1):  # round 0 warms up (and creates the optimizer states)
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            with PeakRSS() as mem:
                start = time.perf_counter()
                sides[name]()
                elapsed = time.perf_counter() - start
            if rep:
                times[name].append(elapsed)
            peaks[name] = max(peaks[name], mem.peak - mem.base)
    ours_state = state_mb([p for c in actor.model for p in c.parameters()]) + state_mb(
        [b.grad_data for c in actor.model for b in c.buffers]) + state_mb(
        [v for s in getattr(actor.optimizer, "optimizer", actor.optimizer).state.values() for v in s.values()
         if torch.is_tensor(v) and v.dim()])
    hf_state = state_mb(list(hf.parameters()) + [p.grad for p in hf.parameters() if p.grad is not None]) + state_mb(
        [v for s in hf_opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    for name in sides:
        state = hf_state if name == "transformers" else ours_state
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:12s} step median {statistics.median(times[name]):7.2f} s ({runs})  {rate[name]:7.1f} tokens/s"
              f"  step peak RSS +{peaks[name] / 2**20:.0f} MB over the step's start, "
              f"weights+grads+optimizer state {state:.0f} MB")
    print(f"ours with each sample's prompt packed whole (parallel.share_prompts: false) over transformers: "
          f"{rate['ours-unshared'] / rate['transformers']:.3f}; shared over unshared: "
          f"{rate['ours'] / rate['ours-unshared']:.3f}")
    results.add("train_vs_hf", rate["ours"] / rate["transformers"])


if __name__ == "__main__":
    main()
