"""Asynchronous RL (eta = 4) against synchronous RL (eta = 0, no overlap): trained tokens per second.

Both runs are the real main job, ``megatron-areal train``, started one after the other by this
script with the same model, data, seed, sizes and number of training steps (so the same number
of trained samples); only ``staleness.eta`` / ``staleness.overlap`` differ. Each run is one
embedded rollout server and one trainer process, each with one thread (``OMP_NUM_THREADS=1``):
on a 2-core machine that gives one core to generation and one to training, so overlapping them
is possible at all, and neither run can win by grabbing more cores than the other.

Workload: a tiny random Llama (``tiny-llama``, 128-token vocabulary) sampled at temperature 1
on arithmetic prompts. Its output is close to uniform over the vocabulary, so a sample ends
with probability about 1/128 per token: lengths are geometric with a mean near 100 tokens and
a tail that reaches ``max_new_tokens`` (400) in most batches of 32 (the script prints the
measured mean, per-batch maximum and truncated fraction). A synchronous batch lasts as long as
its longest sample while the server decodes fewer and fewer sequences; the asynchronous run
keeps the server's batch full and trains while generating. SmolLM2-135M gives a similar tail at
high temperature but decodes at about 30 tokens/s on one shared CPU thread, too slow for a
benchmark that runs in minutes.

What bounds the gain on a CPU: the embedded server's decode step costs far more with a full
batch than with the few sequences of a synchronous tail (tiny-llama, one thread, measured on a
loaded 2-core machine: 5 ms at batch 1, 9 ms at 8, 17 ms at 32, 30 ms at 64 with ~100-token
contexts, and 55 ms at 64 with ~400-token contexts, since attention pads every row to the
longest context in the batch), so keeping the batch full buys less than on a GPU; training is
only about a third of a synchronous step, which caps what overlapping can save; and each weight
update interrupts the samples in flight, which the server then prefills again. The machine's
other load changes from run to run, so the pairs are interleaved and repeated, and the result
is the ratio of the totals.

Measured per run, over the training loop only (model loading and server start-up are the same
for both and excluded): wall time (sum of step times), trained tokens/s (response tokens in the
trained batches), trained samples/s, the trainer's idle fraction (time waiting for a batch) and
the generator's idle fraction (time the server had no request), step-time weighted.

    python bench/async_vs_sync.py [--steps 20 --batch-size 8 --group-size 4 --max-new-tokens 400]

Last line: ``RESULT async_vs_sync <ratio>`` (trained tokens/s, asynchronous / synchronous).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_areal.netutil import free_port
from megatron_areal.rundir import RunDir

MODES = {"sync": {"eta": 0, "overlap": False}, "async": {"eta": 4, "overlap": True}}


@dataclass
class RunFigures:
    mode: str
    process_s: float  # the whole command, start-up included
    loop_s: float  # the training loop: sum of step times
    steps: int
    samples: int
    tokens: float  # response tokens trained
    trainer_idle: float
    generator_idle: float
    gen_tokens_per_s: float
    len_mean: float
    len_batch_max: float
    truncated: float
    staleness_max: float
    interrupted: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.loop_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s


def run_config(args: argparse.Namespace, mode: str, run_dir: Path, seed: int) -> dict:
    return {
        "train": {"run_dir": str(run_dir), "steps": args.steps, "eval_every": 0, "seed": seed},
        "model": {"path": args.model, "max_seq_len": args.max_seq_len},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": args.batch_size, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "max_concurrent": args.max_concurrent, "filter_equal_rewards": False},
        "staleness": MODES[mode],
        "server": {"count": 1, "max_running": args.max_concurrent * args.group_size, "base_port": free_port()},
        "cluster": {"master_port": free_port()},
        "data": {"train": "arithmetic", "eval": "", "seed": seed},
        "reward": {"workers": 1},
        "checkpoint": {"every": 0},
        "logging": {"progress": False},
    }


def run(args: argparse.Namespace, mode: str, root: Path, seed: int) -> RunFigures:
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / mode
    config = root / f"{mode}.yaml"
    config.write_text(yaml.safe_dump(run_config(args, mode, run_dir, seed)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megatron_areal.cli", "train", str(config)], env=env,
                            capture_output=True, text=True, timeout=args.timeout)
    process_s = time.monotonic() - t0
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed ({result.returncode}); logs in {RunDir(run_dir).logs}\n"
                         f"{result.stderr[-2000:]}")
    return figures(mode, run_dir, process_s)


def figures(mode: str, run_dir: Path, process_s: float) -> RunFigures:
    rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    ledger = [json.loads(line) for line in RunDir(run_dir).trained.read_text().splitlines()]
    loop_s = sum(r["perf/step_time_s"] for r in steps)

    def weighted(key: str) -> float:  # per-step figures weighted by the step's duration
        return sum(r[key] * r["perf/step_time_s"] for r in steps) / loop_s

    def mean(key: str) -> float:
        return sum(r[key] for r in steps) / len(steps)

    return RunFigures(
        mode=mode, process_s=process_s, loop_s=loop_s, steps=len(steps),
        samples=sum(len(e["staleness"]) for e in ledger), tokens=sum(r["train/tokens"] for r in steps),
        trainer_idle=sum(r["perf/batch_wait_s"] for r in steps) / loop_s,
        generator_idle=weighted("perf/generator_idle_fraction"),
        gen_tokens_per_s=weighted("perf/gen_tokens_per_s"),
        len_mean=mean("rollout/response_len_mean"), len_batch_max=mean("rollout/response_len_max"),
        truncated=mean("rollout/truncated_fraction"),
        staleness_max=max(r["rollout/staleness_max"] for r in steps),
        interrupted=mean("rollout/interrupted_fraction"))


def report(results: list[RunFigures]) -> None:
    rows = [
        ("steps / trained samples", lambda f: f"{f.steps} / {f.samples}"),
        ("training-loop wall time (s)", lambda f: f"{f.loop_s:.1f}"),
        ("whole command incl. start-up (s)", lambda f: f"{f.process_s:.1f}"),
        ("trained tokens", lambda f: f"{f.tokens:.0f}"),
        ("trained tokens/s", lambda f: f"{f.tokens_per_s:.1f}"),
        ("trained samples/s", lambda f: f"{f.samples_per_s:.2f}"),
        ("trainer idle fraction", lambda f: f"{f.trainer_idle:.2f}"),
        ("generator idle fraction", lambda f: f"{f.generator_idle:.2f}"),
        ("generated tokens/s", lambda f: f"{f.gen_tokens_per_s:.0f}"),
        ("response length: mean / batch max", lambda f: f"{f.len_mean:.0f} / {f.len_batch_max:.0f}"),
        ("truncated fraction", lambda f: f"{f.truncated:.3f}"),
        ("max staleness trained", lambda f: f"{f.staleness_max:.0f}"),
        ("interrupted fraction (re-prefilled)", lambda f: f"{f.interrupted:.2f}"),
    ]
    print(f"{'':36}" + "".join(f"{f.mode:>14}" for f in results), flush=True)
    for label, fmt in rows:
        print(f"{label:36}" + "".join(f"{fmt(f):>14}" for f in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--steps", type=int, default=20,
                   help="asynchronous generation runs ahead and what is in flight at the end is never "
                        "trained, so short runs understate it")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-concurrent", type=int, default=16, help="groups in flight (async); server slots = x group")
    p.add_argument("--seed", type=int, default=1, help="of the first repeat; repeat i uses seed + i")
    p.add_argument("--repeats", type=int, default=3, help="sync/async pairs, run interleaved")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--keep", help="keep the run directories under this folder")
    args = p.parse_args()

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    root.mkdir(parents=True, exist_ok=True)
    pairs = []
    # Interleaved, so a change in the machine's load hits both modes; each repeat samples a new
    # seed (prompts, sampling, initial order), the same for both modes.
    for i in range(args.repeats):
        pair = [run(args, mode, root / f"rep{i}", args.seed + i) for mode in MODES]
        report(pair)
        pairs.append(pair)
        print(f"repeat {i}: async/sync trained tokens/s {pair[1].tokens_per_s / pair[0].tokens_per_s:.2f}\n",
              flush=True)
    sync_tokens, async_tokens = (sum(p[k].tokens for p in pairs) for k in (0, 1))
    sync_s, async_s = (sum(p[k].loop_s for p in pairs) for k in (0, 1))
    print(f"all {args.repeats} repeats: sync {sync_tokens / sync_s:.1f} trained tokens/s over {sync_s:.0f} s, "
          f"async {async_tokens / async_s:.1f} over {async_s:.0f} s")
    print(f"RESULT async_vs_sync {(async_tokens / async_s) / (sync_tokens / sync_s):.2f}")


if __name__ == "__main__":
    main()
