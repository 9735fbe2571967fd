"""Held-out gain per minute: the main job against the plain loop a user would write, each run at least twice.

Arm ``ours`` is the main job, ``megatron-areal train CONFIG`` (default: the README's
``configs/smollm2_arith.yaml``) in a fresh run directory. Arm ``plain`` is ``bench/plain_grpo.py``:
transformers ``generate`` and a token-level PPO-clip step in one synchronous loop on every core,
given the main job's own settings from the same config (learning rate, prompts x samples per step,
temperature, response length, steps, clip, the training prompts in the same order, the same
held-out problems, template and answer check, the compute dtype). With ``--sweep`` the plain loop
first runs each learning rate x prompts per step (x compute dtype, ``--sweep-dtype``) of a small grid
once and keeps the setting that gained the most per minute (the table is printed); the plain arm's
runs then use it, its first run being the sweep's run of that setting (same seed, same command).

Each run's gain per minute is its held-out accuracy after the last step minus before the first, in
points, over the whole command's wall time in minutes: start-up, model loading and both
evaluations count on both sides. Run ``i`` of both arms uses seed ``--seed + i`` (``train.seed``
and ``data.seed``); the arms alternate (ours, plain, ours, plain, ...) so that a change of load on a
shared machine touches both.

``RESULT gain_per_minute_vs_plain R (min A, max B over N x N run pairs)``: R is the mean gain per
minute of ours over the plain loop's; A and B the lowest and highest ratio of one run of ours to
one plain run. It is printed only once every check passed: each run finished its steps, the two
arms measured the same base accuracy (same model and problems, greedy) within 3 points, and the
plain loop's mean gain is positive (else the ratio says nothing). Each accuracy is on the held-out
set (200 problems by default: binomial standard error about 3 points), so two runs per arm resolve
large differences only.

About 2 x (main job + plain loop) minutes: 25-40 minutes on a 2-core machine; run it on a quiet
machine (each run prints the load average at its end).

    python bench/time_to_accuracy.py [--runs 2] [--sweep] [--steps N] [--config configs/smollm2_arith.yaml]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mainjob import RunRecord, run_train  # noqa: E402

PLAIN = Path(__file__).resolve().parent / "plain_grpo.py"
BASE_AGREEMENT = 0.03  # same model, same problems, both greedy: the base accuracies must agree


@dataclass(frozen=True)
class Run:
    """One finished run of an arm: held-out accuracy before and after, the command's wall time."""

    arm: str
    seed: int
    before: float
    after: float
    wall_s: float
    steps: int
    load: float  # 5-minute load average at its end

    @property
    def gain_points(self) -> float:
        return 100 * (self.after - self.before)

    @property
    def gain_per_min(self) -> float:
        return self.gain_points / (self.wall_s / 60)

    def line(self) -> str:
        return (f"  {self.arm:5}  seed {self.seed}  {100 * self.before:5.1f}% -> {100 * self.after:5.1f}% "
                f"({self.gain_points:+5.1f} points) in {self.wall_s:5.0f} s: {self.gain_per_min:+6.2f} points/min, "
                f"{self.steps} steps, load {self.load:.1f}")


def run_ours(args: argparse.Namespace, seed: int, root: Path) -> Run:
    run_dir = root / f"ours-{seed}"
    done = root / f"ours-{seed}.run.json"
    if (earlier := read_back(done)) is not None:
        return earlier
    overrides = [f"train.seed={seed}", f"data.seed={seed}", "train.eval_every=0", "checkpoint.every=0"]
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    wall = run_train(args.config, run_dir, overrides + args.override, args.timeout)
    record = RunRecord.read(run_dir)
    evals = {e["label"]: e["accuracy"] for e in record.evals}
    steps = max((m["step"] for m in record.metrics), default=0)
    if "before" not in evals or "after" not in evals:
        raise SystemExit(f"{run_dir}: the main job recorded no before/after evaluation ({record.evals})")
    run = Run("ours", seed, evals["before"], evals["after"], wall, steps, os.getloadavg()[1])
    done.write_text(json.dumps(dataclasses.asdict(run)))
    return run


def read_back(record: Path) -> Run | None:
    """A run finished earlier into the same ``--keep`` directory (an interrupted comparison goes on)."""
    if not record.exists():
        return None
    run = Run(**json.loads(record.read_text()))
    print(f"read back from {record}", flush=True)
    return run


def run_plain(args: argparse.Namespace, seed: int, root: Path, lr: float | None = None,
              batch: int | None = None, dtype: str | None = None, label: str = "plain") -> Run:
    out = root / f"{label}-{seed}-{lr}-{batch}-{dtype}.json"
    record = out.with_suffix(".run.json")
    if (earlier := read_back(record)) is not None:
        return earlier
    cmd = [sys.executable, str(PLAIN), "--config", str(args.config), "--seed", str(seed), "--data-seed", str(seed),
           "--out", str(out)]
    for flag, value in (("--steps", args.steps or None), ("--lr", lr), ("--batch", batch), ("--dtype", dtype)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += args.override  # the same config changes as the main job's (a smaller held-out set, say)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0  # the whole command, as for the main job
    if proc.returncode != 0:
        raise SystemExit(f"the plain loop failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    points = result["points"]
    run = Run(label, seed, points[0]["accuracy"], points[-1]["accuracy"], wall, points[-1]["step"],
              os.getloadavg()[1])
    record.write_text(json.dumps(dataclasses.asdict(run)))
    return run


def sweep(args: argparse.Namespace, root: Path) -> tuple[tuple[float, int, str | None], Run]:
    """Each learning rate x prompts per step x compute dtype of the grid once (seed ``--seed``); the best gain
    per minute wins. The winner's run is the plain arm's first run: the same command with the same seed."""
    runs = {}
    for setting in itertools.product(args.sweep_lr, args.sweep_batch, args.sweep_dtype or [None]):
        runs[setting] = r = run_plain(args, args.seed, root, *setting, label="sweep")
        print(f"sweep {describe(setting)}:\n{r.line()}", flush=True)
    best = max(runs, key=lambda k: runs[k].gain_per_min)
    print(f"sweep: the plain loop gains most per minute with {describe(best)}", flush=True)
    return best, dataclasses.replace(runs[best], arm="plain")


def describe(setting: tuple[float, int, str | None]) -> str:
    lr, batch, dtype = setting
    return f"lr {lr:g}, {batch} prompts per step" + (f", {dtype}" if dtype else "")


def spread(ours: list[Run], plain: list[Run]) -> tuple[float, float, float]:
    """Ratio of the arms' mean gains per minute, and the lowest and highest ratio over all run pairs."""
    pairs = [o.gain_per_min / p.gain_per_min for o in ours for p in plain if p.gain_per_min > 0]
    mean = statistics.fmean(r.gain_per_min for r in ours) / statistics.fmean(r.gain_per_min for r in plain)
    return mean, min(pairs, default=float("nan")), max(pairs, default=float("nan"))


def check(ours: list[Run], plain: list[Run], steps: int) -> list[str]:
    """What must hold before a ratio means anything (empty when all holds)."""
    problems = [f"{r.arm} seed {r.seed} trained {r.steps} of {steps} steps" for r in ours + plain if r.steps != steps]
    base_ours = statistics.fmean(r.before for r in ours)
    base_plain = statistics.fmean(r.before for r in plain)
    if abs(base_ours - base_plain) > BASE_AGREEMENT:
        problems.append(f"the arms disagree on the base model's accuracy ({100 * base_ours:.1f}% vs "
                        f"{100 * base_plain:.1f}%): they are not evaluating the same thing")
    if statistics.fmean(r.gain_per_min for r in plain) <= 0:
        problems.append("the plain loop gained nothing on average: a ratio against it says nothing")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"))
    parser.add_argument("--runs", type=int, default=2, help="runs per arm (at least 2)")
    parser.add_argument("--seed", type=int, default=1, help="run i uses seed + i, both arms")
    parser.add_argument("--steps", type=int, default=0, help="steps of every run (0: the config's train.steps)")
    parser.add_argument("--sweep", action="store_true", help="give the plain loop the best of a small sweep")
    parser.add_argument("--sweep-lr", type=float, nargs="+", default=[1e-5, 2e-5], help="learning rates to sweep")
    parser.add_argument("--sweep-batch", type=int, nargs="+", default=[1, 3], help="prompts per step to sweep")
    parser.add_argument("--sweep-dtype", nargs="+", default=None, choices=("float32", "bfloat16"),
                        help="compute dtypes to sweep (default: the main job's model.dtype only)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep run directories and outputs here; runs finished there earlier are read back")
    parser.add_argument("override", nargs="*", help="key=value overrides of the config, for both arms")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs must be at least 2: a ratio needs its spread")
    root = args.keep or Path(tempfile.mkdtemp(prefix="time_to_accuracy-"))
    root.mkdir(parents=True, exist_ok=True)
    from megatron_areal.config import load_config

    steps = args.steps or load_config(str(args.config), args.override).train.steps
    setting, swept = sweep(args, root) if args.sweep else ((None, None, None), None)
    ours, plain = [], []
    for i in range(args.runs):
        seed = args.seed + i
        ours.append(run_ours(args, seed, root))
        print(ours[-1].line(), flush=True)
        plain.append(swept if i == 0 and swept else run_plain(args, seed, root, *setting))
        print(plain[-1].line(), flush=True)
    print("\nruns (held-out accuracy before -> after, the whole command's wall time):")
    for r in ours + plain:
        print(r.line())
    for name, runs in (("ours", ours), ("plain", plain)):
        g = [r.gain_per_min for r in runs]
        print(f"{name:5} gain per minute: mean {statistics.fmean(g):+.2f}, runs {', '.join(f'{x:+.2f}' for x in g)}")
    problems = check(ours, plain, steps)
    if problems:
        raise SystemExit("no RESULT: " + "; ".join(problems))
    mean, low, high = spread(ours, plain)
    chosen = f"{describe(setting)} (sweep)" if args.sweep else "the main job's settings"
    print(f"plain loop with {chosen}; {args.runs} runs per arm, {steps} steps each")
    print(f"RESULT gain_per_minute_vs_plain {mean:.2f} (min {low:.2f}, max {high:.2f} over "
          f"{len(ours)} x {len(plain)} run pairs)")


if __name__ == "__main__":
    main()
