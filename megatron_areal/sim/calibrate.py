"""Fit the simulator's free figures to a real run's TensorBoard scalars, then say how well the
fitted model predicts that run's own step times.

Only three figures are fitted, each from the scalar that measures it; hardware and model facts
never move:

- ``decode_step_overhead_s`` from the generation rate while busy,
  ``perf/gen_tokens_per_s / (1 - perf/generator_idle_fraction)``, by bisection over simulations;
- ``train_mfu`` from the training rate while busy,
  ``perf/train_tokens_per_s / (1 - perf/trainer_idle_fraction)``, against the cost model;
- ``update_overhead_s`` from ``perf/weight_sync_s`` minus the modelled transfer time.

Rates are per second of wall time, idle fractions are shares of wall time (what the trainer logs).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.sim.costs import CostModel
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.result import RunResult
from megatron_areal.sim.scenario import Scenario
from megatron_areal.sim.workload import LengthSampler

TAGS = ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s", "perf/step_time_s",
        "perf/trainer_idle_fraction", "perf/generator_idle_fraction", "rollout/staleness_mean")
REQUIRED = ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/step_time_s")


class CalibrationError(ValueError):
    pass


def read_scalars(run_dir: str | Path) -> dict[str, list[float]]:
    """Scalars of every event file under ``run_dir``, by tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise CalibrationError(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*) found")
    series: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in set(acc.Tags().get("scalars", [])) & set(TAGS):
            for ev in acc.Scalars(tag):
                series.setdefault(tag, {})[ev.step] = ev.value
    missing = [t for t in REQUIRED if t not in series]
    if missing:
        raise CalibrationError(f"{run_dir}: event files lack the scalars {', '.join(missing)}")
    return {tag: [v for _, v in sorted(d.items())] for tag, d in series.items()}


def _busy_rate(scalars: dict[str, list[float]], rate: str, idle: str) -> float:
    r = statistics.fmean(scalars[rate])
    f = statistics.fmean(scalars[idle]) if idle in scalars else 0.0
    if f >= 1:
        raise CalibrationError(f"{idle} averages {f:.2f}: the side never worked")
    return r / (1 - f)


def _bisect(fn, lo: float, hi: float, target: float, iters: int, log_scale: bool) -> float:
    """x in [lo, hi] with fn(x) ~= target, fn decreasing in x."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if log_scale else (lo + hi) / 2
        if fn(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log_scale else (lo + hi) / 2


def _batch_shape(sc: Scenario, scalars: dict[str, list[float]]) -> tuple[float, float]:
    """Tokens per trained batch as logged (rate x step time), and the sum of squared sequence
    lengths (attention cost) of the workload's length law scaled to that token count."""
    tokens = statistics.fmean(r * t for r, t in zip(scalars["perf/train_tokens_per_s"],
                                                     scalars["perf/step_time_s"]))
    sim = sc.sim
    lengths = LengthSampler(sim.prompt_mean_tokens, sim.response_mean_tokens, sim.response_sigma,
                            sc.max_new_tokens, sim.seed)
    seqs = [lengths.prompt() + lengths.response() for _ in range(sc.batch_size * sc.group_size)]
    scale = tokens / sum(seqs)
    return tokens, sum((s * scale) ** 2 for s in seqs)


def _train_busy_rate(sc: Scenario, sim, tokens: float, sq: float) -> float:
    """Trained tokens per busy trainer second: the step itself plus sending the weights."""
    cost = CostModel(sc.model, sc.gpu, sim)
    t = cost.train_time(tokens, sq, sc.train_gpus, sc.train_tp, sc.train_pp, sc.n_minibatches,
                        sc.max_tokens_per_mb, ep=sc.train_ep, etp=sc.train_etp, gpus_per_node=sc.gpus_per_node)
    return tokens / (t + cost.weight_update_time(sc.train_pp, sc.colocated))


def _gen_busy_rate(sc: Scenario) -> float:
    r = simulate(sc)
    return r.gen_tokens_per_s / max(r.gen_utilisation, 1e-9)


@dataclass
class Calibration:
    fitted: dict[str, float]
    measured_step_time: float
    predicted_step_time: float
    per_step_error: float  # mean |predicted - measured| / measured over aligned steps
    result: RunResult

    @property
    def step_time_error(self) -> float:
        return abs(self.predicted_step_time - self.measured_step_time) / self.measured_step_time

    def describe(self) -> str:
        fitted = ", ".join(f"{k} = {v:.4g}" for k, v in self.fitted.items())
        return (f"fitted: {fitted}\n"
                f"step time: measured {self.measured_step_time:.3f} s, predicted "
                f"{self.predicted_step_time:.3f} s ({100 * self.step_time_error:.1f}% off; "
                f"per-step mean error {100 * self.per_step_error:.1f}%)")


def calibrate(sc: Scenario, scalars: dict[str, list[float]]) -> Calibration:
    gen_target = _busy_rate(scalars, "perf/gen_tokens_per_s", "perf/generator_idle_fraction")
    train_target = _busy_rate(scalars, "perf/train_tokens_per_s", "perf/trainer_idle_fraction")
    sim = sc.sim
    if "perf/weight_sync_s" in scalars:
        bare = CostModel(sc.model, sc.gpu, dataclasses.replace(sim, update_overhead_s=0.0))
        xfer = bare.weight_update_time(sc.train_pp, sc.colocated)
        sync_s = statistics.fmean(scalars["perf/weight_sync_s"])
        sim = dataclasses.replace(sim, update_overhead_s=max(0.0, sync_s - xfer))
    tokens, sq = _batch_shape(sc, scalars)
    mfu = _bisect(lambda m: -_train_busy_rate(sc, dataclasses.replace(sim, train_mfu=m), tokens, sq),
                  1e-4, 1.0, -train_target, 40, log_scale=True)
    sim = dataclasses.replace(sim, train_mfu=mfu)

    def gen_rate(overhead: float) -> float:
        return _gen_busy_rate(sc.replace(sim=dataclasses.replace(sim, decode_step_overhead_s=overhead)))

    overhead = _bisect(gen_rate, 1e-6, 10.0, gen_target, 24, log_scale=True)
    sim = dataclasses.replace(sim, decode_step_overhead_s=overhead)
    result = simulate(sc.replace(sim=sim))
    measured = scalars["perf/step_time_s"]
    w = sim.warmup_steps
    pred_steps, meas_steps = result.step_times[w:], measured[w:] or measured
    n = min(len(pred_steps), len(meas_steps))
    pairs = list(zip(pred_steps[:n], meas_steps[:n]))
    per_step = statistics.fmean(abs(p - m) / m for p, m in pairs) if pairs else math.nan
    return Calibration(fitted={"decode_step_overhead_s": overhead, "train_mfu": mfu,
                               "update_overhead_s": sim.update_overhead_s},
                       measured_step_time=statistics.fmean(meas_steps),
                       predicted_step_time=result.step_time, per_step_error=per_step, result=result)
