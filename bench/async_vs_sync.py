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

Measured per run, over the training loop only (model loading and server start-up are the same
for both and excluded): wall time (sum of step times), trained tokens/s (response tokens in the
trained batches), trained samples/s, the trainer's idle fraction (time waiting for a batch) and
the generator's idle fraction (time the server had no request), step-time weighted.

    python bench/async_vs_sync.py [--steps 10 --batch-size 8 --group-size 4 --max-new-tokens 400]

Last line: ``RESULT async_vs_sync <ratio>`` (trained tokens/s, asynchronous / synchronous).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.loop_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args: argparse.Namespace, mode: str, run_dir: Path) -> dict:
    return {
        "train": {"run_dir": str(run_dir), "steps": args.steps, "eval_every": 0, "seed": args.seed},
        "model": {"path": args.model, "max_seq_len": args.max_seq_len},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": args.batch_size, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "max_concurrent": args.max_concurrent, "filter_equal_rewards": False},
        "staleness": MODES[mode],
        "server": {"count": 1, "max_running": args.max_concurrent * args.group_size, "base_port": free_port()},
        "cluster": {"master_port": free_port()},
        "data": {"train": "arithmetic", "eval": "", "seed": args.seed},
        "reward": {"workers": 1},
        "checkpoint": {"every": 0},
        "logging": {"progress": False},
    }


def run(args: argparse.Namespace, mode: str, root: Path) -> RunFigures:
    run_dir = root / mode
    config = root / f"{mode}.yaml"
    config.write_text(yaml.safe_dump(run_config(args, mode, run_dir)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megatron_areal.cli", "train", str(config)], env=env,
                            capture_output=True, text=True, timeout=args.timeout)
    process_s = time.monotonic() - t0
    if result.returncode != 0:
        raise SystemExit(f"{mode} run failed ({result.returncode}); logs in {run_dir / 'logs'}\n"
                         f"{result.stderr[-2000:]}")
    return figures(mode, run_dir, process_s)


def figures(mode: str, run_dir: Path, process_s: float) -> RunFigures:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
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
        staleness_max=max(r["rollout/staleness_max"] for r in steps))


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
    ]
    print(f"{'':36}" + "".join(f"{f.mode:>14}" for f in results))
    for label, fmt in rows:
        print(f"{label:36}" + "".join(f"{fmt(f):>14}" for f in results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-concurrent", type=int, default=16, help="groups in flight (async); server slots = x group")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--keep", help="keep the run directories under this folder")
    args = p.parse_args()

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    root.mkdir(parents=True, exist_ok=True)
    results = [run(args, mode, root) for mode in MODES]
    report(results)
    sync, asyn = results
    print(f"RESULT async_vs_sync {asyn.tokens_per_s / sync.tokens_per_s:.2f}")


if __name__ == "__main__":
    main()
