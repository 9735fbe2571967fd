"""``megatron-areal simulate CONFIG.yaml [key=value ...]``: predict a run before launching it.

Reads the same config tree as ``megatron-areal train`` (plus its ``sim`` section) and prints the
predicted time per step and per 1,000 steps, the weight push's seconds and share of a step
(``sim/push.py``, both paths), each side's utilisation, the staleness
distribution, and how the run compares with its synchronous baseline. ``--sweep`` recommends a
split and eta; ``--plots DIR`` writes the scaling curve and timelines; ``--calibrate RUN_DIR``
fits the free figures to a finished run's TensorBoard logs.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from megatron_areal.config import ConfigError, load_config
from megatron_areal.sim import push, report
from megatron_areal.sim.calibrate import CalibrationError
from megatron_areal.sim.engine import DeadlockError, simulate
from megatron_areal.sim.scenario import ScenarioError, from_config

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-areal simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="run config (YAML), the one `megatron-areal train` reads")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. cluster.nodes=32")
    p.add_argument("--sweep", action="store_true", help="sweep the gen/train split and eta; recommend a plan")
    p.add_argument("--plots", metavar="DIR", help="write throughput-vs-GPUs and timeline PNGs to DIR")
    p.add_argument("--calibrate", metavar="RUN_DIR", help="fit overheads and utilisation to a run's logs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _predict(cfg) -> tuple:
    runs = {}
    for mode in ("async", "sync"):
        sc = from_config(cfg, mode=mode)
        runs[mode] = simulate(sc, record_timeline=True)
    return runs["async"], runs["sync"]


def _sweep(cfg, progress: bool) -> None:
    from megatron_areal.sim.planner import recommend, sweep

    points = sweep(cfg, progress=progress)
    print("\nsplit x eta sweep (time per step, s):")
    fracs = sorted({p.gen_fraction for p in points})
    etas = sorted({p.eta for p in points})
    print("  gen share " + "".join(f"  eta={e:<5}" for e in etas))
    for f in fracs:
        row = {p.eta: p.step_time for p in points if p.gen_fraction == f}
        print(f"  {f:9.3f} " + "".join(f"  {row[e]:9.1f}" if e in row else "  " + "-" * 9 for e in etas))
    best = recommend(points)
    sc = best.result.scenario
    print(f"\nrecommended: cluster.gen_fraction={best.gen_fraction} staleness.eta={best.eta} "
          f"({sc.n_servers} servers x tp {sc.server_tp}, {sc.train_gpus} training GPUs): "
          f"{best.step_time:.1f} s per step, {best.step_time * 1000 / 3600:.1f} h per 1,000 steps")


def _plots(cfg, out: Path, async_r, sync_r, progress: bool) -> None:
    from megatron_areal.sim.planner import scaling
    from megatron_areal.sim.plots import plot_scaling, plot_timelines

    out.mkdir(parents=True, exist_ok=True)
    points = scaling(cfg, progress=progress)
    print(f"\nthroughput vs GPUs ({cfg.model.path}), trained tokens/s:")
    for n in sorted({p.gpus for p in points}):
        row = {p.mode: p.result.train_tokens_per_s for p in points if p.gpus == n}
        a, s = row.get("async", float("nan")), row.get("sync", float("nan"))
        print(f"  {n:4d} GPUs  async {a:10.0f}  sync {s:10.0f}")
    a = plot_scaling(points, out / "scaling.png", f"{cfg.model.path}: throughput vs GPUs")
    b = plot_timelines([("async", async_r), ("sync", sync_r)], out / "timeline.png")
    print(f"wrote {a} and {b}")


def _calibrate(cfg, run_dir: str) -> None:
    from megatron_areal.sim.calibrate import calibrate, read_scalars

    sc = from_config(cfg, mode="config")
    cal = calibrate(sc, read_scalars(run_dir))
    print(f"\ncalibration against {run_dir}:\n{cal.describe()}")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    progress = not args.no_progress
    try:
        cfg = load_config(args.config, args.overrides)
        if args.calibrate:
            _calibrate(cfg, args.calibrate)
            return 0
        async_r, sync_r = _predict(cfg)
    except (ConfigError, ScenarioError, CalibrationError, DeadlockError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}")
        return 2
    print(report.describe(async_r))
    print(push.describe(async_r.scenario, async_r.step_time))
    print(report.describe(sync_r))
    print(report.compare(async_r, sync_r))
    if args.sweep:
        _sweep(cfg, progress)
    if args.plots:
        _plots(cfg, Path(args.plots), async_r, sync_r, progress)
    return 0
