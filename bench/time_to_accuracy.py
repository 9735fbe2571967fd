"""Held-out accuracy against training time: the main job against the plain loop a user would write.

Arm ``ours`` is the main job itself, ``megatron-areal train CONFIG`` (default: the README's
``configs/smollm2_arith.yaml``) with ``train.eval_every`` set, so the trainer evaluates the 200
held-out problems every few steps. Arm ``plain`` is ``bench/plain_grpo.py``: transformers
``generate`` and a token-level PPO-clip step in one synchronous loop (fp32, 8 prompts x 8 samples,
temperature 0.7, lr 5e-6: the settings that did best in a plain loop on this kind of machine), on
the same model, training problems (same seed), held-out problems, chat template and answer check,
with every core of the machine. The plain loop trains for as many seconds as the main job did.

Time axis: seconds of training, start-up, model loading and the held-out evaluations excluded on
both sides (for the main job: the sum of its step times; its server keeps generating rollouts while
the trainer evaluates, which this leaves in its favour, about one step's worth of generation per
evaluation). The whole command's wall time of each arm is printed as well.

Result: A* is the lower of the two final accuracies (the plain loop's own final accuracy when the
main job reaches it); T(A*) is the training time at which an arm's held-out accuracy first reached
A*. ``RESULT time_to_accuracy_vs_plain T_plain(A*) / T_ours(A*)``: above 1 the main job gets there
sooner. Each accuracy is on 200 problems (binomial standard error about 3 points), evaluated every
``--eval-every`` steps, so a single run resolves differences of a few evaluation intervals only.

Takes about twice the main job's time (25-30 minutes on a 2-core machine). The arms run one after
the other, so run it on a quiet machine: other work during one arm only biases the ratio (both
arms print the load average at their end).

    python bench/time_to_accuracy.py [--config configs/smollm2_arith.yaml --eval-every 4 --seed 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plain_grpo  # noqa: E402
from mainjob import RunRecord, run_train  # noqa: E402


def run_ours(args: argparse.Namespace, run_dir: Path) -> tuple[list[dict], float]:
    """The main job with periodic evaluations -> its evaluation points and the command's wall time."""
    wall = run_train(args.config, run_dir, [f"train.eval_every={args.eval_every}", f"train.seed={args.seed}",
                                            f"data.seed={args.seed}", "checkpoint.every=0", *args.override],
                     args.timeout)
    return RunRecord.read(run_dir).eval_points(), wall


def time_to(points: list[dict], accuracy: float) -> float | None:
    """Training seconds at the first evaluation that reached ``accuracy``."""
    return next((p["train_s"] for p in points if p["accuracy"] >= accuracy - 1e-9), None)


def curve(name: str, points: list[dict]) -> None:
    for p in points:
        print(f"  {name:5}  step {p['step']:3d}  train {p['train_s']:6.0f} s  held-out {100 * p['accuracy']:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plain_grpo.add_arguments(parser)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"))
    parser.add_argument("--eval-every", type=int, default=4, help="steps between held-out evaluations, both arms")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the main job's run directory here")
    parser.add_argument("override", nargs="*", help="key=value overrides for the main job")
    args = parser.parse_args()

    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="time_to_accuracy-")) / "ours"
    ours, ours_wall = run_ours(args, run_dir)
    print(f"ours: {len(ours)} evaluations, whole command {ours_wall:.0f} s (load average at the end "
          f"{os.getloadavg()[1]:.1f} over 5 min)", flush=True)
    curve("ours", ours)

    args.budget_s = ours[-1]["train_s"]
    t0 = time.monotonic()
    plain = plain_grpo.run(args, log=lambda line: print(line, flush=True))
    plain_wall = time.monotonic() - t0
    print(f"plain: {len(plain)} evaluations, whole run {plain_wall:.0f} s (model load included; load average "
          f"at the end {os.getloadavg()[1]:.1f} over 5 min)")
    curve("plain", plain)

    if abs(ours[0]["accuracy"] - plain[0]["accuracy"]) > 0.03:  # same model, same problems, both greedy
        raise SystemExit(f"the two arms disagree on the base model's accuracy ({ours[0]['accuracy']:.3f} vs "
                         f"{plain[0]['accuracy']:.3f}): they are not evaluating the same thing")
    target = min(ours[-1]["accuracy"], plain[-1]["accuracy"])
    t_ours, t_plain = time_to(ours, target), time_to(plain, target)
    print(f"final held-out accuracy: ours {100 * ours[-1]['accuracy']:.1f}% after {ours[-1]['train_s']:.0f} s, "
          f"plain {100 * plain[-1]['accuracy']:.1f}% after {plain[-1]['train_s']:.0f} s of training")
    print(f"time to {100 * target:.1f}%: ours {t_ours:.0f} s, plain {t_plain:.0f} s")
    print(f"RESULT time_to_accuracy_vs_plain {t_plain / max(t_ours, 1e-9):.2f}")


if __name__ == "__main__":
    main()
