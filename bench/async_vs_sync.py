"""Asynchronous RL (eta = 4) against synchronous RL (eta = 0, no overlap): trained tokens per second.

Every run is the real main job, ``megatron-areal train``, started one after the other by this
script with the same model, data, seed, sizes and number of training steps (so the same number
of trained samples; the script fails, with no RESULT line, if they differ). Each run is one
embedded rollout server and one trainer process; the arms differ in ``staleness.eta`` /
``staleness.overlap`` and in the torch threads of each role (``server.threads``,
``cluster.cpu_threads``, which the launcher turns into each role's ``OMP_NUM_THREADS``):

- ``async``: eta 4 with overlap, one thread per role: on a 2-core machine one core generates
  while the other trains.
- ``sync-1t``: eta 0, one thread per role: the same thread budget as ``async``, so one core is
  idle in every phase. This isolates what overlapping buys, but no synchronous system would be
  configured this way.
- ``sync-2t``: eta 0, two threads per role. Generation and training alternate, so each phase gets
  both cores: what a synchronous system would use.

The RESULT is against the faster of the two synchronous arms, whichever it is on the machine.

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
other load changes from run to run, so the arms are interleaved (in an order that rotates between
repeats) and repeated, and the ratios are of the totals. Each run prints the machine's load
average at its start and end: two threads per role can only help when two cores are free.

Measured per run, over the training loop only (model loading and server start-up are excluded):
wall time (sum of step times), trained tokens/s (response tokens in the trained batches), trained
samples/s, the trainer's idle fraction (time waiting for a batch) and the generator's idle
fraction (time the server had no request), step-time weighted.

    python bench/async_vs_sync.py [--steps 20 --batch-size 8 --group-size 4 --max-new-tokens 400]

Prints every ratio as an ordinary line; last line: ``RESULT async_vs_sync <ratio>`` (trained
tokens/s, ``async`` over the faster synchronous arm).

Measured with the defaults (20 steps, 3 repeats interleaved, 640 trained samples per run) on a quiet
2-core AMD EPYC (Zen 4), at 167b1ea: trained tokens/s ``sync-1t`` 2116.8, ``sync-2t`` 1966.6, ``async``
2823.3; async / sync-1t 1.33 (the RESULT; per repeat 1.26-1.44), async / sync-2t 1.44. Two threads per
role do not speed this tiny model's decode steps (``sync-2t`` / ``sync-1t`` 0.86-1.07 per repeat).
Before 167b1ea the launcher made a synchronous run's roles sleep at every OpenMP barrier whenever their
threads together outnumbered the cores, though they take turns: ``sync-2t`` then ran at 0.36-0.46x
``sync-1t`` (742 against 1857 trained tokens/s in one repeat here before the fix). ``sync-1t`` was not
affected and was the RESULT's arm then too; the RESULT moves with the machine's state (1.52 in that
repeat, 1.68 over 3 repeats in an earlier session).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_areal.rundir.layout import RunDir
from megatron_areal.util.netutil import free_port

MODES = {"sync": {"eta": 0, "overlap": False}, "async": {"eta": 4, "overlap": True}}


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str  # a key of MODES
    threads: int  # torch threads of the server and of the trainer (server.threads, cluster.cpu_threads)


# sync-1t has the thread budget of async (one core per role); sync-2t is what a synchronous system
# would use on 2 cores: each phase (generation, then training) gets both, the other role being idle.
ARMS = [Arm("sync-1t", "sync", 1), Arm("sync-2t", "sync", 2), Arm("async", "async", 1)]


@dataclass
class RunFigures:
    arm: str
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
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at start and end

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.loop_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s


def run_config(args: argparse.Namespace, arm: Arm, run_dir: Path, seed: int) -> dict:
    return {
        "train": {"run_dir": str(run_dir), "steps": args.steps, "eval_every": 0, "seed": seed},
        "model": {"path": args.model, "max_seq_len": args.max_seq_len},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": args.batch_size, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "max_concurrent": args.max_concurrent, "filter_equal_rewards": False},
        "staleness": MODES[arm.mode],
        "server": {"count": 1, "max_running": args.max_concurrent * args.group_size, "base_port": free_port(),
                   "threads": arm.threads},
        "cluster": {"master_port": free_port(), "cpu_threads": arm.threads},
        "data": {"train": "arithmetic", "eval": "", "seed": seed},
        "reward": {"workers": 1},
        "checkpoint": {"every": 0},
        "logging": {"progress": False},
    }


def run(args: argparse.Namespace, arm: Arm, root: Path, seed: int) -> RunFigures:
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / arm.name
    config = root / f"{arm.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(args, arm, run_dir, seed)))
    # The launcher sets each role's OMP_NUM_THREADS from server.threads / cluster.cpu_threads; this
    # only keeps the launcher's own process (and anything it runs in-process) at one thread.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megatron_areal.cli", "train", str(config)], env=env,
                            capture_output=True, text=True, timeout=args.timeout)
    process_s = time.monotonic() - t0
    if result.returncode != 0:
        raise SystemExit(f"{arm.name} run failed ({result.returncode}); logs in {RunDir(run_dir).logs}\n"
                         f"{result.stderr[-2000:]}")
    f = figures(arm.name, run_dir, process_s)
    f.load = (load0, os.getloadavg()[0])
    return f


def figures(arm: str, run_dir: Path, process_s: float) -> RunFigures:
    rows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    ledger = [json.loads(line) for line in RunDir(run_dir).trained.read_text().splitlines()]
    loop_s = sum(r["perf/step_time_s"] for r in steps)

    def weighted(key: str) -> float:  # per-step figures weighted by the step's duration
        return sum(r[key] * r["perf/step_time_s"] for r in steps) / loop_s

    def mean(key: str) -> float:
        return sum(r[key] for r in steps) / len(steps)

    return RunFigures(
        arm=arm, process_s=process_s, loop_s=loop_s, steps=len(steps),
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
        ("load average at start / end", lambda f: f"{f.load[0]:.1f} / {f.load[1]:.1f}"),
    ]
    print(f"{'':36}" + "".join(f"{f.arm:>14}" for f in results), flush=True)
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
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three arms, run interleaved")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--keep", help="keep the run directories under this folder")
    args = p.parse_args()

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        measure(args, root)
    finally:
        if not args.keep:  # every run keeps a checkpoint: hundreds of MB each
            shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, root: Path) -> None:
    """The interleaved repeats of every arm under ``root``, their ratios and the RESULT line."""
    repeats = []
    # Interleaved, so a change in the machine's load hits every arm; each repeat samples a new
    # seed (prompts, sampling, initial order), the same for all arms.
    for i in range(args.repeats):
        # The order rotates from repeat to repeat so that no arm always runs first or last.
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]
        done = {arm.name: run(args, arm, root / f"rep{i}", args.seed + i) for arm in order}
        figs = [done[arm.name] for arm in ARMS]
        report(figs)
        repeats.append(figs)
        sync1, sync2, asyn = (f.tokens_per_s for f in figs)
        print(f"repeat {i}: trained tokens/s async/sync-1t {asyn / sync1:.2f}, async/sync-2t {asyn / sync2:.2f}, "
              f"sync-2t/sync-1t {sync2 / sync1:.2f}\n", flush=True)
    # The same work in every arm, or the ratios compare different things.
    bad = [f"repeat {i} {f.arm}: {f.steps} steps / {f.samples} samples"
           for i, figs in enumerate(repeats) for f in figs
           if f.steps != args.steps or f.samples != figs[0].samples]
    if bad:
        raise SystemExit(f"arms did not train {args.steps} steps of the same number of samples: {'; '.join(bad)}")
    rate = {}
    for k, arm in enumerate(ARMS):
        tokens, loop_s = sum(r[k].tokens for r in repeats), sum(r[k].loop_s for r in repeats)
        rate[arm.name] = tokens / loop_s
        print(f"all {args.repeats} repeats, {arm.name} ({arm.mode}, {arm.threads} thread(s) per role): "
              f"{rate[arm.name]:.1f} trained tokens/s over {loop_s:.0f} s")
    print(f"sync-2t / sync-1t {rate['sync-2t'] / rate['sync-1t']:.2f}")
    print(f"async / sync-1t (same threads per role) {rate['async'] / rate['sync-1t']:.2f}")
    print(f"async / sync-2t (both cores per phase) {rate['async'] / rate['sync-2t']:.2f}")
    best = max(("sync-1t", "sync-2t"), key=rate.__getitem__)
    print(f"the faster synchronous arm: {best}")
    print(f"RESULT async_vs_sync {rate['async'] / rate[best]:.2f}")


if __name__ == "__main__":
    main()
