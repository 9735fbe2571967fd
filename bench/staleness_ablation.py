"""Staleness ablation: does decoupled PPO keep learning where naive PPO does not, with stale data?

The paper's ablation (AReaL, arXiv 2505.24298): at eta 4, naive PPO loses quality and decoupled
PPO keeps it. Each arm here is the main job itself (``megatron-areal train``, default config
``configs/smollm2_arith.yaml``: SmolLM2-135M on arithmetic, 200 held-out problems, greedy) with
the same seeds, steps, batch, rollout concurrency and per-arm time limit; only these differ:

    eta0            staleness.eta=0                      synchronous: every sample on-policy
    eta4_naive      staleness.eta=4 ppo.decoupled=false  proximal policy = behaviour policy
    eta4_decoupled  staleness.eta=4                      decoupled PPO (paper Eq. 5)
    eta1, eta8      (--extra-arms) decoupled at eta 1 and 8

Staleness is made real: the rollout concurrency (``rollout.max_concurrent``, default
``(largest eta + 1) x batch_size`` groups, for every arm) lets the server run up to eta batches
ahead of the trainer, which on two cores is the slower side, so the eta-4 arms train on samples up
to 4 versions old. The measured staleness of every trained sample (``RUN_DIR/trained.jsonl``) is
reported per arm; an eta > 0 arm that never trained a stale sample, or any sample staler than its
eta, is a failed bench (non-zero exit, no RESULT lines).

Output: held-out accuracy at every ``--eval-every`` steps, mean reward per step, and the staleness
distribution of each arm, side by side in a text table (printed and written to
``OUT/staleness_ablation.txt``) and plotted to ``OUT/staleness_ablation.png``; then

    RESULT heldout_accuracy_<arm> <percent>      final held-out accuracy of each arm
    RESULT decoupled_minus_naive_eta4 <points>   eta4_decoupled - eta4_naive, percentage points

Each accuracy is on 200 problems (binomial standard error about 3 points, printed with the
difference), so one seed resolves only large effects; "no effect measured" is a valid reading.

Resumable: each arm runs in ``OUT/<arm>``; an arm whose run finished (its final evaluation is in
``eval.jsonl``) is not run again, and an interrupted arm resumes from its newest checkpoint
(``checkpoint.every`` = ``--eval-every``) through the main job's normal resume.

Duration on a 2-core machine (the main job: about 40 s a step, 25-40 s per evaluation): about
20 minutes an arm at the defaults (24 steps, an evaluation every 4), so about 1 hour for the three
arms and 1 hour 40 minutes with ``--extra-arms``. Run it on a quiet machine:

    python bench/staleness_ablation.py --out runs/staleness_ablation [--extra-arms]

A check of the machinery in a few minutes (tiny random model, no learning expected):

    python bench/staleness_ablation.py --out /tmp/sa --steps 2 --eval-every 1 --eval-size 4 \\
        model.path=tiny-llama rollout.filter_equal_rewards=false rollout.max_new_tokens=8
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mainjob import RunRecord, run_train  # noqa: E402

ARMS = {  # name: (eta, decoupled)
    "eta0": (0, True),
    "eta4_naive": (4, False),
    "eta4_decoupled": (4, True),
}
EXTRA_ARMS = {"eta1": (1, True), "eta8": (8, True)}


def arm_overrides(args: argparse.Namespace, eta: int, decoupled: bool, max_concurrent: int) -> list[str]:
    return [f"train.steps={args.steps}", f"train.eval_every={args.eval_every}", f"train.seed={args.seed}",
            f"data.seed={args.seed}", f"data.eval_size={args.eval_size}", f"checkpoint.every={args.eval_every}",
            "checkpoint.keep=1", "checkpoint.resume=true", "logging.progress=false",
            f"rollout.max_concurrent={max_concurrent}", f"staleness.eta={eta}",
            f"ppo.decoupled={'true' if decoupled else 'false'}", *args.override]


def run_arm(args: argparse.Namespace, name: str, eta: int, decoupled: bool, max_concurrent: int) -> RunRecord:
    run_dir = args.out / name
    record = RunRecord.read(run_dir)
    if record.finished(args.steps):
        print(f"{name}: already finished in {run_dir}, not run again", flush=True)
        return record
    state = "resuming" if record.metrics else "starting"
    print(f"{name}: {state} (eta {eta}, {'decoupled' if decoupled else 'naive'} PPO) in {run_dir}", flush=True)
    wall = run_train(args.config, run_dir, arm_overrides(args, eta, decoupled, max_concurrent), args.arm_timeout)
    record = RunRecord.read(run_dir)
    train_s = sum(v for _, v in record.series("perf/step_time_s"))
    print(f"{name}: done in {wall:.0f} s ({train_s:.0f} s of training steps; load average "
          f"{os.getloadavg()[1]:.1f} over 5 min)", flush=True)
    return record


def histogram(values: list[int]) -> dict[int, float]:
    counts = Counter(values)
    return {k: counts[k] / max(len(values), 1) for k in sorted(counts)}


def table(arms: dict[str, tuple[int, bool]], records: dict[str, RunRecord]) -> str:
    names = list(arms)
    head = f"{'':>24}" + "".join(f"{n:>16}" for n in names)
    lines = ["held-out accuracy (%) by step", head]
    steps = sorted({e["step"] for r in records.values() for e in r.evals})
    for step in steps:
        cells = []
        for n in names:
            acc = next((e["accuracy"] for e in records[n].evals if e["step"] == step), None)
            cells.append(f"{100 * acc:16.1f}" if acc is not None else f"{'-':>16}")
        lines.append(f"{'step ' + str(step):>24}" + "".join(cells))
    lines += ["", "mean reward per step", head]
    rewards = {n: dict(records[n].series("rollout/reward_mean")) for n in names}
    for step in sorted({s for r in rewards.values() for s in r}):
        lines.append(f"{'step ' + str(step):>24}" + "".join(
            f"{rewards[n][step]:16.3f}" if step in rewards[n] else f"{'-':>16}" for n in names))
    lines += ["", "staleness of trained samples (fraction of samples)", head]
    hists = {n: histogram(records[n].staleness()) for n in names}
    for s in sorted({k for h in hists.values() for k in h}):
        lines.append(f"{'staleness ' + str(s):>24}" + "".join(f"{hists[n].get(s, 0.0):16.3f}" for n in names))
    stats = []
    for n in names:
        values = records[n].staleness()
        stats.append((n, sum(values) / max(len(values), 1), max(values, default=0), len(values)))
    lines.append(f"{'mean':>24}" + "".join(f"{m:16.2f}" for _, m, _, _ in stats))
    lines.append(f"{'max':>24}" + "".join(f"{x:16d}" for _, _, x, _ in stats))
    lines.append(f"{'samples':>24}" + "".join(f"{c:16d}" for _, _, _, c in stats))
    train_s = [sum(v for _, v in records[n].series("perf/step_time_s")) for n in names]
    lines += ["", f"{'training seconds':>24}" + "".join(f"{t:16.0f}" for t in train_s)]
    return "\n".join(lines)


def plot(arms: dict[str, tuple[int, bool]], records: dict[str, RunRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, rew_ax, st_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(arms)
    for i, name in enumerate(arms):
        rec = records[name]
        acc_ax.plot([e["step"] for e in rec.evals], [100 * e["accuracy"] for e in rec.evals], marker="o", label=name)
        steps, rewards = zip(*rec.series("rollout/reward_mean")) if rec.series("rollout/reward_mean") else ((), ())
        rew_ax.plot(steps, rewards, label=name)
        hist = histogram(rec.staleness())
        st_ax.bar([k + (i - (len(arms) - 1) / 2) * width for k in hist], list(hist.values()), width=width, label=name)
    acc_ax.set(title="held-out accuracy", xlabel="step", ylabel="%")
    rew_ax.set(title="mean reward of the trained batch", xlabel="step", ylabel="reward")
    st_ax.set(title="staleness of trained samples", xlabel="policy versions", ylabel="fraction of samples")
    st_ax.set_xticks(range(max((eta for eta, _ in arms.values()), default=0) + 1))
    for ax in (acc_ax, rew_ax, st_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check(arms: dict[str, tuple[int, bool]], records: dict[str, RunRecord], steps: int) -> list[str]:
    """The bench's own checks: what must hold for its figures to mean anything."""
    problems = []
    for name, (eta, _) in arms.items():
        rec, values = records[name], records[name].staleness()
        if not rec.finished(steps) or len(rec.trained) != steps:
            problems.append(f"{name}: trained {len(rec.trained)} of {steps} steps or has no final evaluation")
        if max(values, default=0) > eta:
            problems.append(f"{name}: a sample {max(values)} versions old was trained (eta {eta})")
        if eta > 0 and max(values, default=0) == 0:
            problems.append(f"{name}: eta {eta} but every trained sample was on-policy (staleness 0): "
                            "the arm does not test staleness (raise rollout.max_concurrent or server.count)")
    base = {n: next((e["accuracy"] for e in r.evals if e["step"] == 0), None) for n, r in records.items()}
    known = [v for v in base.values() if v is not None]
    if len(known) != len(base):
        problems.append(f"an arm has no step-0 evaluation: {base}")
    elif max(known) - min(known) > 0.03:  # same weights, same problems, greedy
        problems.append(f"the arms disagree on the base model's accuracy {base}: they do not evaluate the same thing")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"))
    parser.add_argument("--out", type=Path, default=Path("runs/staleness_ablation"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=4, help="steps between held-out evaluations")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems per evaluation")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--extra-arms", action="store_true", help="also run decoupled PPO at eta 1 and eta 8")
    parser.add_argument("--max-concurrent", type=int, default=0,
                        help="rollout.max_concurrent of every arm (0: (largest eta + 1) x rollout.batch_size)")
    parser.add_argument("--arm-timeout", type=float, default=3 * 3600.0, help="wall-clock limit of each arm, seconds")
    parser.add_argument("override", nargs="*", help="key=value overrides for every arm")
    args = parser.parse_args()

    arms = {**ARMS, **(EXTRA_ARMS if args.extra_arms else {})}
    batch = yaml.safe_load(args.config.read_text()).get("rollout", {}).get("batch_size", 8)
    for item in args.override:
        if item.startswith("rollout.batch_size="):
            batch = int(item.split("=", 1)[1])
    max_concurrent = args.max_concurrent or (max(eta for eta, _ in arms.values()) + 1) * batch
    print(f"arms {', '.join(arms)}: {args.steps} steps, evaluation every {args.eval_every} on {args.eval_size} "
          f"held-out problems, seed {args.seed}, rollout.max_concurrent {max_concurrent} groups of "
          f"{batch} per batch; run directories under {args.out}", flush=True)
    records = {name: run_arm(args, name, eta, dec, max_concurrent) for name, (eta, dec) in arms.items()}

    text = table(arms, records)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "staleness_ablation.txt").write_text(text + "\n")
    plot(arms, records, args.out / "staleness_ablation.png")
    print(f"table and plot: {args.out / 'staleness_ablation.txt'}, {args.out / 'staleness_ablation.png'}")

    problems = check(arms, records, args.steps)
    if problems:
        raise SystemExit("staleness ablation: checks failed, no RESULT:\n  " + "\n  ".join(problems))
    final = {name: records[name].evals[-1]["accuracy"] for name in arms}
    n = records["eta4_naive"].evals[-1].get("n", args.eval_size)
    diff = final["eta4_decoupled"] - final["eta4_naive"]
    se = math.sqrt(sum(p * (1 - p) / max(n, 1) for p in (final["eta4_decoupled"], final["eta4_naive"])))
    print(f"eta 4: decoupled {100 * final['eta4_decoupled']:.1f}% vs naive {100 * final['eta4_naive']:.1f}% "
          f"({100 * diff:+.1f} points, standard error of the difference about {100 * se:.1f} points on {n} problems)")
    for name in arms:
        print(f"RESULT heldout_accuracy_{name} {100 * final[name]:.1f}")
    print(f"RESULT decoupled_minus_naive_eta4 {100 * diff:.1f}")


if __name__ == "__main__":
    main()
