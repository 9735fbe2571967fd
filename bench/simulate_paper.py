"""The simulator against the paper's published figures, with no constant fitted to them.

Prints, side by side in one run: the asynchronous speedup over synchronous for the 1.5B (16
nodes) and 7B (24 nodes) settings against the paper's 2.77x and 2.27x; the generation-throughput
gain of interruptible generation on 4 nodes against +12% and +17%; how the speedup moves with the
one workload assumption (mean response length); and throughput from 16 to 512 GPUs.
Last line: ``RESULT sim_vs_paper_worst_error <fraction>``, the worst relative error over the four
figures the paper claims and the simulator reproduces: the two speedups and the two interruptible-
generation gains (a gain's error is relative to the paper's gain: +20 points on a +12% claim is
an error of 1.67). Each error is printed on its own line above; the ratio of simulated to published
absolute hours is printed as measured.

Usage: python bench/simulate_paper.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from megatron_areal.config import load_config
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.planner import scaling
from megatron_areal.sim.scenario import from_config

ROOT = Path(__file__).resolve().parent.parent
PAPER_SPEEDUP = {"1.5b": 2.77, "7b": 2.27}  # Table 1: 41.0 h / 14.8 h and 57.7 h / 25.4 h
PAPER_HOURS = {"1.5b": (41.0, 14.8), "7b": (57.7, 25.4)}  # sync, async; 1,000 steps
PAPER_INTERRUPT = {"1.5b": 0.12, "7b": 0.17}  # generation throughput gain on 4 nodes


def config(size: str, *overrides: str):
    return load_config(ROOT / "configs" / f"paper_{size}.yaml", list(overrides))


def speedup(size: str, steps: list[str]) -> tuple[float, float, float]:
    cfg = config(size, *steps)
    a = simulate(from_config(cfg, mode="async"))
    s = simulate(from_config(cfg, mode="sync"))
    return s.step_time / a.step_time, s.step_time, a.step_time


def interrupt_gain(size: str, steps: list[str]) -> tuple[float, float, float]:
    """4 nodes, servers kept saturated (eta large, 2 batches in flight) so the figure is the
    generation side's throughput under the trainer's update cadence, as in the paper's ablation."""
    rates = []
    for flag in ("true", "false"):
        cfg = config(size, *steps, "cluster.nodes=4", "staleness.eta=1000", "rollout.max_concurrent=1024",
                     f"sim.interruptible={flag}")
        rates.append(simulate(from_config(cfg, mode="async")).gen_tokens_per_s)
    return rates[0] / rates[1] - 1, rates[0], rates[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer simulated steps")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    steps = ["sim.steps=12", "sim.warmup_steps=4"] if args.quick else ["sim.steps=24", "sim.warmup_steps=6"]
    t0 = time.time()
    errors: dict[str, float] = {}
    hours: dict[str, tuple[float, float]] = {}
    print("async speedup over sync, same GPUs (sim: steady state, response mean 8k tokens, sigma 1.0)")
    for size, nodes in (("1.5b", 16), ("7b", 24)):
        ratio, sync_s, async_s = speedup(size, steps)
        err = abs(ratio / PAPER_SPEEDUP[size] - 1)
        errors[f"speedup {size}"] = err
        hours[size] = (sync_s / 3.6 / PAPER_HOURS[size][0], async_s / 3.6 / PAPER_HOURS[size][1])
        print(f"  {size:>4} on {nodes} nodes: sim {ratio:.2f}x ({sync_s:.0f} s -> {async_s:.0f} s per step, "
              f"{sync_s / 3.6:.1f} h -> {async_s / 3.6:.1f} h per 1,000 steps)   "
              f"paper {PAPER_SPEEDUP[size]:.2f}x ({PAPER_HOURS[size][0]} h -> {PAPER_HOURS[size][1]} h)"
              f"   error {100 * err:.1f}%", flush=True)
        alt = speedup(size, [*steps, "sim.sync_placement=colocated"])
        print(f"        (not scored) were the sync baseline time-sharing all GPUs instead of the 1:1 split: "
              f"{alt[0]:.2f}x", flush=True)
    print("interruptible generation, generation throughput gain on 4 nodes")
    for size in ("1.5b", "7b"):
        gain, on, off = interrupt_gain(size, steps)
        paper = PAPER_INTERRUPT[size]
        errors[f"interruptible gain {size}"] = abs(gain - paper) / paper
        print(f"  {size:>4}: sim {100 * gain:+.1f}% ({off:.0f} -> {on:.0f} tokens/s)   paper "
              f"{100 * paper:+.0f}%   off by {100 * (gain - paper):+.1f} points", flush=True)
    print("sensitivity of the speedup to the assumed mean response length (not fitted; shown)")
    quick = ["sim.steps=12", "sim.warmup_steps=4"]
    for mean in (5000, 11000):
        over = [*quick, f"sim.response_mean_tokens={mean}"]
        row = [f"{speedup(size, over)[0]:.2f}x" for size in ("1.5b", "7b")]
        print(f"  mean {mean:>5} tokens: 1.5b {row[0]}, 7b {row[1]}", flush=True)
    print("throughput vs GPUs, 1.5B, trained tokens/s (per GPU in brackets)")
    points = scaling(config("1.5b", *quick), progress=False)
    for n in sorted({p.gpus for p in points}):
        row = {p.mode: p.result.train_tokens_per_s for p in points if p.gpus == n}
        cells = "  ".join(f"{m} {row[m]:9.0f} ({row[m] / n:6.0f})" for m in ("async", "sync") if m in row)
        print(f"  {n:4d} GPUs  {cells}", flush=True)
    worst = max(errors, key=errors.get)
    print(f"wall {time.time() - t0:.0f} s")
    print("why the interruptible gain misses: without interruption a server admits nothing until its\n"
          "longest in-flight response (up to 27,648 tokens) ends, so the loss is drain time over update\n"
          "interval. The paper does not state its 4-node split or update interval; the sim takes the 3:1\n"
          "split of the configs, whose trainer sets the interval (short for 1.5B, long for 7B).")
    for size, (sync_x, async_x) in hours.items():
        print(f"absolute hours, sim over paper, {size}: sync {sync_x:.2f}x, async {async_x:.2f}x (the async runs are "
              f"trainer-bound at the assumed 40% MFU and 8k-token mean response; see the sensitivity)")
    for name, err in errors.items():
        print(f"error {name}: {100 * err:.1f}%")
    print(f"worst: {worst} ({100 * errors[worst]:.1f}%)")
    print(f"RESULT sim_vs_paper_worst_error {errors[worst]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
