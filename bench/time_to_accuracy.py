"""Time to a held-out accuracy level: the main job against the plain loops a user would write.

Three arms, side by side in one run, each run a fresh command on the same cores:

- ``ours``: the main job, ``megatron-areal train CONFIG`` (default: the README's
  ``configs/smollm2_arith.yaml``), evaluating every ``--eval-every`` steps (``train.eval_every``);
- ``plain``: ``bench/plain_grpo.py``, transformers ``generate`` and a PPO-clip step in one
  synchronous loop on every core, the vanilla loop a user writes: a step whose groups were all equal
  trains nothing and still counts;
- ``plain_dynamic``: the same loop with the main job's dynamic sampling (``--dynamic-sampling``):
  all-equal groups are dropped and the next prompts generated until the step's batch is informative.
  ``plain`` against ``plain_dynamic`` is the algorithm's share of the gain; ``plain_dynamic``
  against ``ours`` the system's.

All arms take the main job's settings from the same config (prompts in the same order, samples per
prompt, temperature, response length, clip), the same held-out problems, chat template and answer
check, the same seeds (run ``i``: ``--seed + i``, both ``train.seed`` and ``data.seed``).

A run's figure is the wall time from the command's start until an evaluation first reports held-out
accuracy >= ``--level``: start-up, model loading and every evaluation count, on both sides, read on
one clock (each evaluation records the wall-clock time its result was known: ``eval.jsonl`` for the
main job, ``--evals`` for the plain loop). The bench stops a run once it has reached the level, or at
``--limit-s``: a run that has not reached the level by then is censored and counts at the limit. An
arm's figure is the median over ``--runs`` seeds; every seed's figure is printed, none dropped.

``--sweep`` first runs every arm at each learning rate x prompts per step x compute dtype of a grid
(seed ``--seed``), prints the table, and gives each arm its fastest setting (ties: the higher
accuracy reached); an arm's first run is then its sweep run of that setting (same seed, same command).

``RESULT time_to_level_vs_plain R``: the vanilla loop's median time to the level over ours;
``RESULT time_to_level_vs_plain_dynamic R``: the dynamic-sampling loop's over ours. Printed only when
every check passed: every run evaluated the base model first and failed in nothing, no run ran out of
steps before the limit without reaching the level (raise ``--steps``), every evaluation used the same
number of problems, the arms agree on the base model's accuracy (same model and problems, greedy), and
the main job's median run reached the level (a censored median on its side gives no ratio). A plain
arm whose median is censored gives a ratio that is a lower bound (said in the output).

    python bench/time_to_accuracy.py [--runs 4] [--level 0.3] [--limit-s 1200] [--eval-every 3] [--sweep]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mainjob import stop, train_command  # noqa: E402
from results import Results  # noqa: E402

from megatron_areal.rundir.layout import RunDir  # noqa: E402

PLAIN = Path(__file__).resolve().parent / "plain_grpo.py"
ARMS = ("ours", "plain", "plain_dynamic")
POLL_S = 1.0
BASE_AGREEMENT = 0.03  # same model, same problems, both greedy: base accuracies agree within 3 points
BASE_AGREEMENT_PROBLEMS = 2  # ... or two problems, whichever is more (a small --eval-size)


@dataclass(frozen=True)
class Setting:
    """One point of the sweep; None keeps the config's value."""

    lr: float | None = None
    batch: int | None = None
    dtype: str | None = None

    def describe(self) -> str:
        parts = [f"lr {self.lr:g}" if self.lr else "", f"{self.batch} prompts/step" if self.batch else "",
                 self.dtype or ""]
        return ", ".join(p for p in parts if p) or "the config's settings"

    def main_job_overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in (("optimizer.lr", self.lr), ("rollout.batch_size", self.batch),
                                                    ("model.dtype", self.dtype)) if value is not None]

    def plain_flags(self) -> list[str]:
        return [arg for flag, value in (("--lr", self.lr), ("--batch", self.batch), ("--dtype", self.dtype))
                if value is not None for arg in (flag, str(value))]


@dataclass(frozen=True)
class Run:
    """One run of an arm: its evaluations as [seconds since the command's start, step, accuracy, problems]."""

    arm: str
    seed: int
    setting: Setting
    evals: list[list[float]]
    reached_s: float | None  # first evaluation at or above the level, within the limit; None: censored
    ended: str  # "level", "limit" or "steps" (the command finished its steps first)
    limit_s: float
    load: float  # 5-minute load average at its end

    @property
    def censored(self) -> bool:
        return self.reached_s is None

    @property
    def time_s(self) -> float:
        """The run's figure: the time to the level, or the limit when censored."""
        return self.limit_s if self.reached_s is None else self.reached_s

    def figure(self) -> str:
        return f">{self.limit_s:.0f} s (censored)" if self.censored else f"{self.reached_s:.0f} s"

    def line(self) -> str:
        curve = ", ".join(f"{t:.0f} s {100 * acc:.1f}% (step {int(step)})" for t, step, acc, _ in self.evals)
        return (f"  {self.arm:13} seed {self.seed}  {self.setting.describe()}: {self.figure()}, ended at "
                f"{self.ended}, load {self.load:.1f}\n      held-out: {curve}")

    @classmethod
    def from_json(cls, text: str) -> Run:
        fields = json.loads(text)
        return cls(**{**fields, "setting": Setting(**fields["setting"])})


def eval_points(path: Path, t0: float) -> list[list[float]]:
    """Evaluations recorded so far in a JSON-lines file of ``{"step", "accuracy", "n", "time"}``; a line still
    being written is read at the next poll."""
    if not path.is_file():
        return []
    points = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "time" not in record:
            raise SystemExit(f"{path}: an evaluation without its wall-clock time ({record}); the bench needs it "
                             "to read the time to the level")
        points.append([record["time"] - t0, record["step"], record["accuracy"], record["n"]])
    return points


def watch(cmd: list[str], evals: Path, log: Path, level: float, limit_s: float) -> tuple[list, float | None, str]:
    """Run ``cmd`` until an evaluation in ``evals`` reaches ``level``, the limit passes or it ends by itself;
    stop it -> its evaluations, the time to the level (None: not within the limit), why it ended."""
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            exited = proc.poll() is not None
            points = eval_points(evals, t0)  # after poll(): an exited command's last evaluation is in
            reached = next((t for t, _, acc, _ in points if acc >= level and t <= limit_s), None)
            if reached is not None:
                return points, reached, "level"
            if exited:
                if proc.returncode != 0:
                    raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\nits output ({log}) ends:\n"
                                     f"{log.read_text()[-3000:]}")
                return points, None, "steps"
            if time.time() - t0 >= limit_s:
                return points, None, "limit"
            time.sleep(POLL_S)
    finally:
        stop(proc)


def arm_command(args: argparse.Namespace, arm: str, seed: int, setting: Setting, out: Path) -> tuple[list[str], Path]:
    """The arm's command and the file its evaluations go to."""
    if arm == "ours":
        overrides = [f"train.seed={seed}", f"data.seed={seed}", f"train.steps={args.steps}",
                     f"train.eval_every={args.eval_every}", "checkpoint.every=0", "logging.progress=false"]
        return train_command(args.config, out, overrides + setting.main_job_overrides() + args.override), \
            RunDir(out).evals
    cmd = [sys.executable, str(PLAIN), "--config", str(args.config), "--seed", str(seed), "--data-seed", str(seed),
           "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--threads", str(args.threads),
           "--evals", str(out / "evals.jsonl"), *setting.plain_flags()]
    if arm == "plain_dynamic":
        cmd.append("--dynamic-sampling")
    return cmd + args.override, out / "evals.jsonl"  # the same config changes as the main job's


def run_arm(args: argparse.Namespace, arm: str, seed: int, setting: Setting, root: Path) -> Run:
    name = f"{arm}-{seed}-{setting.lr}-{setting.batch}-{setting.dtype}"
    done = root / f"{name}.run.json"
    if done.exists():  # finished earlier into the same --keep directory: an interrupted comparison goes on
        print(f"read back from {done}", flush=True)
        return Run.from_json(done.read_text())
    out = root / name
    if out.exists():
        raise SystemExit(f"{out} holds an unfinished run: remove it to run it again")
    out.mkdir(parents=True)
    cmd, evals = arm_command(args, arm, seed, setting, out)
    points, reached, ended = watch(cmd, evals, root / f"{name}.log", args.level, args.limit_s)
    run = Run(arm, seed, setting, points, reached, ended, args.limit_s, os.getloadavg()[1])
    done.write_text(json.dumps(dataclasses.asdict(run)))
    print(run.line(), flush=True)
    return run


def sweep(args: argparse.Namespace, root: Path) -> dict[str, Run]:
    """Every arm at every setting of the grid once (seed ``--seed``) -> each arm's fastest run (ties: the higher
    accuracy reached); prints the table."""
    grid = [Setting(*s) for s in itertools.product(args.sweep_lr, args.sweep_batch, runnable(args.sweep_dtype))]
    runs = {(arm, s): run_arm(args, arm, args.seed, s, root) for s in grid for arm in ARMS}
    print(f"\nsweep (seed {args.seed}): time to {100 * args.level:.0f}% held-out, limit {args.limit_s:.0f} s")
    print(f"  {'setting':36}" + "".join(f"{arm:>24}" for arm in ARMS))
    for s in grid:
        print(f"  {s.describe():36}" + "".join(f"{runs[arm, s].figure():>24}" for arm in ARMS))
    best = {}
    for arm in ARMS:
        best[arm] = min((runs[arm, s] for s in grid),
                        key=lambda r: (r.time_s, -max((p[2] for p in r.evals), default=0.0)))
        print(f"sweep: {arm} is fastest with {best[arm].setting.describe()}")
    return best


def runnable(dtypes: list[str]) -> list[str]:
    """The sweep's dtypes as every arm computes them on this CPU (bf16 is fp32 without native bf16 matmuls, for
    the main job and the plain loops alike), each once: the same run is not made twice."""
    from megatron_areal.util.compute_dtype import cpu_dtype_name

    effective = list(dict.fromkeys(cpu_dtype_name(d, "--sweep-dtype") for d in dtypes))
    if effective != list(dict.fromkeys(dtypes)):
        print(f"sweep dtypes {', '.join(dtypes)} run as {', '.join(effective)} on this CPU", flush=True)
    return effective


def median_line(arm: str, runs: list[Run]) -> str:
    med = statistics.median(r.time_s for r in runs)
    censored = sum(r.censored for r in runs)
    return (f"{arm:13} median {med:6.0f} s over {len(runs)} seeds ({censored} censored at the limit): "
            + ", ".join(f"seed {r.seed} {r.figure()}" for r in runs))


def checks(results: Results, runs: dict[str, list[Run]], args: argparse.Namespace) -> None:
    every = [r for rs in runs.values() for r in rs]
    for r in every:
        results.check(bool(r.evals) and r.evals[0][1] == 0,
                      f"{r.arm} seed {r.seed} did not evaluate the base model first ({r.evals[:1]})")
        results.check(r.ended != "steps", f"{r.arm} seed {r.seed} finished its {args.steps} steps before the limit "
                      "without reaching the level: raise --steps, so that only the limit censors a run")
    sizes = {int(p[3]) for r in every for p in r.evals}
    results.check(len(sizes) == 1, f"the evaluations used different numbers of problems: {sorted(sizes)}")
    bases = {arm: statistics.fmean(r.evals[0][2] for r in rs) for arm, rs in runs.items() if all(r.evals for r in rs)}
    n = min(sizes, default=1)
    tolerance = max(BASE_AGREEMENT, BASE_AGREEMENT_PROBLEMS / n)
    results.check(len(bases) < 2 or max(bases.values()) - min(bases.values()) <= tolerance + 1e-9,
                  "the arms disagree on the base model's held-out accuracy ("
                  + ", ".join(f"{arm} {100 * b:.1f}%" for arm, b in bases.items())
                  + "): they are not evaluating the same thing")
    results.check(statistics.median(r.time_s for r in runs["ours"]) < args.limit_s,
                  "the main job's median run did not reach the level within the limit: no ratio")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"))
    parser.add_argument("--level", type=float, default=0.30, help="held-out accuracy to reach (a fraction)")
    parser.add_argument("--limit-s", type=float, default=1200.0, help="censor each run at this many seconds")
    parser.add_argument("--eval-every", type=int, default=3, help="steps between held-out evaluations, every arm")
    parser.add_argument("--runs", type=int, default=4, help="seeds per arm")
    parser.add_argument("--seed", type=int, default=1, help="run i uses seed + i, every arm")
    parser.add_argument("--steps", type=int, default=1000,
                        help="steps cap of every run: large, so that the limit ends a run, not its steps")
    parser.add_argument("--sweep", action="store_true", help="give every arm the best of one sweep")
    parser.add_argument("--sweep-lr", type=float, nargs="+", default=[1e-5, 1.5e-5, 2e-5])
    parser.add_argument("--sweep-batch", type=int, nargs="+", default=[1, 3], help="prompts per step")
    parser.add_argument("--sweep-dtype", nargs="+", default=["bfloat16", "float32"], choices=("float32", "bfloat16"),
                        help="compute dtypes (bf16 runs as fp32 where the CPU has no native bf16, on every arm)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep run directories, logs and records here; runs finished there earlier are read back")
    parser.add_argument("override", nargs="*", help="key=value overrides of the config, for every arm "
                        "(data.eval_size=50, say)")
    args = parser.parse_args()
    if args.runs < 1 or args.eval_every < 1 or args.limit_s <= 0:
        parser.error("--runs and --eval-every must be at least 1, --limit-s positive")
    args.threads = len(os.sched_getaffinity(0))  # the plain loops' torch threads: every core the main job gets
    root = args.keep or Path(tempfile.mkdtemp(prefix="time_to_accuracy-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return measure(args, root)
    finally:
        if not args.keep:  # every run keeps a checkpoint: hundreds of MB each
            shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, root: Path) -> int:
    """Every arm's runs under ``root``, the table of seeds, the medians and the RESULT lines."""
    print(f"level {100 * args.level:.0f}% held-out, limit {args.limit_s:.0f} s, evaluation every {args.eval_every} "
          f"steps, {args.runs} seeds from {args.seed}, {args.threads} cores for every arm; runs in {root}", flush=True)

    best = sweep(args, root) if args.sweep else {arm: None for arm in ARMS}
    runs: dict[str, list[Run]] = {arm: [] for arm in ARMS}
    for i in range(args.runs):
        for arm in ARMS:  # the arms alternate, so that a change of load on a shared machine touches all
            swept = best[arm]
            runs[arm].append(swept if i == 0 and swept else
                             run_arm(args, arm, args.seed + i, swept.setting if swept else Setting(), root))

    print(f"\nruns (time from the command's start to {100 * args.level:.0f}% held-out):")
    for arm in ARMS:
        for r in runs[arm]:
            print(r.line())
    print()
    for arm in ARMS:
        print(median_line(arm, runs[arm]))
    results = Results("time_to_accuracy")
    checks(results, runs, args)
    ours = statistics.median(r.time_s for r in runs["ours"])
    for arm in ("plain", "plain_dynamic"):
        theirs = statistics.median(r.time_s for r in runs[arm])
        bound = " (its median is censored: the ratio is a lower bound)" if theirs >= args.limit_s else ""
        print(f"{arm} median over ours: {theirs:.0f} s / {ours:.0f} s{bound}")
        results.add(f"time_to_level_vs_{arm}", theirs / ours, digits=2)
    return results.emit()


if __name__ == "__main__":
    sys.exit(main())
