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

The workload is the run's, not the ``sim`` section's guess: the response length law is set so that its
mean after truncation at ``max_new_tokens`` is the logged ``rollout/response_len_mean``, the prompt
length follows from the trained tokens with and without prompts, and the share of finished groups
the run threw away untrained (all-equal rewards filtered, stale dropped) becomes the scenario's
``discard_fraction``: a generation-bound run whose filter drops two groups in three needs three times
the generation per step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.rundir.layout import RunDir
from megatron_areal.sim.costs import CostModel
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.push import update_time
from megatron_areal.sim.result import RunResult
from megatron_areal.sim.scenario import Scenario
from megatron_areal.sim.workload import LengthSampler

TAGS = ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/weight_sync_s", "perf/step_time_s",
        "perf/trainer_idle_fraction", "perf/generator_idle_fraction", "rollout/staleness_mean",
        "rollout/response_len_mean", "rollout/filtered_groups", "rollout/dropped_stale",
        "perf/train_all_tokens_per_s", "perf/train_compute_tokens_per_s")
PREDICTED_STEPS = 400  # steps simulated for the predicted step time (the fits simulate ``sim.steps``)
REQUIRED = ("perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/step_time_s")


class CalibrationError(ValueError):
    pass


def read_scalars(run_dir: str | Path) -> dict[str, list[float]]:
    """The run's per-step scalars by tag, in step order: from its ``metrics.jsonl`` (a JSON line per
    step, what the trainer writes besides TensorBoard), else from every event file under ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    lines = RunDir(run_dir).metrics
    files = [] if lines.is_file() else sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    if not files and not lines.is_file():
        raise CalibrationError(f"{lines}: not found, and no TensorBoard event files (events.out.tfevents.*)")
    if lines.is_file():
        for row in map(json.loads, filter(str.strip, lines.read_text().splitlines())):
            for tag in set(row) & set(TAGS):
                series.setdefault(tag, {})[int(row["step"])] = float(row[tag])
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
    """Tokens per busy second over the whole run: every step's tokens over every step's busy time (a
    mean of per-step ratios would overweight short steps, and steps vary when groups are discarded)."""
    times = scalars["perf/step_time_s"]
    idle_f = scalars.get(idle, [0.0] * len(times))
    busy = sum((1 - f) * t for f, t in zip(idle_f, times))
    if busy <= 0:
        raise CalibrationError(f"{idle} is 1 at every step: the side never worked")
    return sum(r * t for r, t in zip(scalars[rate], times)) / busy


def _bisect(fn, lo: float, hi: float, target: float, iters: int, log_scale: bool) -> float:
    """x in [lo, hi] with fn(x) ~= target, fn decreasing in x."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if log_scale else (lo + hi) / 2
        if fn(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log_scale else (lo + hi) / 2


def all_per_trained_token(scalars: dict[str, list[float]]) -> float:
    """Tokens the actor computes on (prompts included) per trained (loss) token: the logged
    ``perf/train_tokens_per_s`` counts loss tokens, the simulator's batches every token. 1 when the run
    did not log both rates."""
    if "perf/train_all_tokens_per_s" not in scalars or "perf/train_compute_tokens_per_s" not in scalars:
        return 1.0
    return max(1.0, statistics.fmean(a / max(c, 1e-9) for a, c in zip(scalars["perf/train_all_tokens_per_s"],
                                                                    scalars["perf/train_compute_tokens_per_s"])))


def _batch_shape(sc: Scenario, scalars: dict[str, list[float]]) -> tuple[float, float]:
    """Tokens per trained batch as logged (rate x step time, prompts included), and the sum of squared
    sequence lengths (attention cost) of the workload's length law scaled to that token count."""
    tokens = all_per_trained_token(scalars) * statistics.fmean(
        r * t for r, t in zip(scalars["perf/train_tokens_per_s"], scalars["perf/step_time_s"]))
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
    return tokens / (t + update_time(sc.replace(sim=sim)))


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
    measured_busy: dict[str, float] = dataclasses.field(default_factory=dict)  # side -> busy share, steady steps

    @property
    def step_time_error(self) -> float:
        return abs(self.predicted_step_time - self.measured_step_time) / self.measured_step_time

    def describe(self) -> str:
        fitted = ", ".join(f"{k} = {v:.4g}" for k, v in self.fitted.items())
        return (f"fitted: {fitted}\n"
                f"step time: measured {self.measured_step_time:.3f} s, predicted "
                f"{self.predicted_step_time:.3f} s ({100 * self.step_time_error:.1f}% off; "
                f"per-step mean error {100 * self.per_step_error:.1f}%)\n"
                f"busy: servers predicted {100 * self.result.gen_utilisation:.0f}%"
                + (f", measured {100 * self.measured_busy['servers']:.0f}%" if "servers" in self.measured_busy else "")
                + f"; trainer predicted {100 * self.result.train_utilisation:.0f}%"
                + (f", measured {100 * self.measured_busy['trainer']:.0f}%" if "trainer" in self.measured_busy else "")
                + f"\ngroups discarded untrained {100 * self.result.scenario.discard_fraction:.0f}%, responses "
                f"{self.result.scenario.sim.response_mean_tokens:.0f} tokens before truncation (mean)")


def _truncated_mean(mean: float, sigma: float, limit: int) -> float:
    """E[min(X, limit)] of a log-normal X with mean ``mean`` and log-space deviation ``sigma``."""
    mu = math.log(mean) - sigma * sigma / 2
    z = (math.log(limit) - mu) / sigma
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731 - the standard normal CDF
    return mean * phi(z - sigma) + limit * (1 - phi(z))


def run_workload(sc: Scenario, scalars: dict[str, list[float]]) -> Scenario:
    """``sc`` with the run's own response and prompt lengths (over the steady steps: a policy that learns
    to answer shorter changes them as it trains) and its share of discarded generation (where the
    scalars have it)."""
    sim = sc.sim
    window = steady(scalars, sim.warmup_steps)
    # rollout/response_len_mean counts the tokens the policy generated per sample (per agent episode),
    # not the tool results and template tokens between an episode's turns: those are prefilled, never
    # decoded, and the simulator's response length is what the servers decode.
    if "rollout/response_len_mean" in window:
        target = statistics.fmean(window["rollout/response_len_mean"])
        if not 0 < target < sc.max_new_tokens:
            raise CalibrationError(f"rollout/response_len_mean averages {target:.1f}, outside (0, "
                                   f"max_new_tokens={sc.max_new_tokens}): not a run of this config")
        mean = _bisect(lambda m: -_truncated_mean(m, sim.response_sigma, sc.max_new_tokens), 1.0, 1e7, -target, 60,
                       log_scale=True)
        sim = dataclasses.replace(sim, response_mean_tokens=mean)
        ratio = all_per_trained_token(window)
        if ratio > 1.0:  # prompt + response over response tokens of the same trained batches
            sim = dataclasses.replace(sim, prompt_mean_tokens=max(1.0, target * (ratio - 1)))
    discard = 0.0
    if "rollout/response_len_mean" in window:
        # The share of the generated tokens no trainer step used (filtered, stale, still in flight): the
        # generation work the simulator must add. Counted in tokens, not groups: the groups thrown away
        # are not as long as the trained ones (all-correct answers are short).
        generated = sum(r * t for r, t in zip(window["perf/gen_tokens_per_s"], window["perf/step_time_s"]))
        trained = sc.batch_size * sc.group_size * sum(window["rollout/response_len_mean"])
        discard = min(0.95, max(0.0, 1 - trained / max(generated, 1e-9)))
    elif "rollout/filtered_groups" in scalars:  # cumulative counts: thrown away over the same steady steps
        steps = len(scalars["perf/step_time_s"])
        first = steps - len(window["perf/step_time_s"])  # the steps ``steady`` left out
        thrown = sum(_since(scalars.get(tag, []), first)
                     for tag in ("rollout/filtered_groups", "rollout/dropped_stale"))
        trained = sc.batch_size * (steps - first)
        discard = thrown / (thrown + trained)
    return sc.replace(sim=sim, discard_fraction=discard)


def _since(cumulative: list[float], first: int) -> float:
    """What a cumulative per-step counter added after its first ``first`` steps (0 for an empty series)."""
    if not cumulative:
        return 0.0
    return cumulative[-1] - (cumulative[first - 1] if first else 0.0)


def steady(scalars: dict[str, list[float]], warmup: int) -> dict[str, list[float]]:
    """The per-step series after the first ``warmup`` steps (the window the prediction is judged on): the
    first steps share the servers with the starting policy's evaluation and fill the pipeline. All of
    them when the run is not longer than its warm-up; cumulative counters keep their whole series."""
    n = len(scalars["perf/step_time_s"])
    if n <= warmup:
        return scalars
    keep = {"rollout/filtered_groups", "rollout/dropped_stale"}
    return {tag: v if tag in keep or len(v) != n else v[warmup:] for tag, v in scalars.items()}


def calibrate(sc: Scenario, scalars: dict[str, list[float]]) -> Calibration:
    sc = run_workload(sc, scalars)
    measured = scalars["perf/step_time_s"]
    scalars = steady(scalars, sc.sim.warmup_steps)
    gen_target = _busy_rate(scalars, "perf/gen_tokens_per_s", "perf/generator_idle_fraction")
    train_target = _busy_rate(scalars, "perf/train_tokens_per_s", "perf/trainer_idle_fraction") * \
        all_per_trained_token(scalars)  # in the simulator's unit: every token of the batch
    sim = sc.sim
    if "perf/weight_sync_s" in scalars:
        xfer = update_time(sc.replace(sim=dataclasses.replace(sim, update_overhead_s=0.0)))
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
    # The prediction is the model's long-run step time: with a batch of one or two groups, a few runs of
    # discarded groups move the mean of a short simulation by tens of percent (the fits above only
    # need rates, which short simulations give).
    result = simulate(sc.replace(sim=dataclasses.replace(sim, steps=max(sim.steps, PREDICTED_STEPS))))
    w = sim.warmup_steps
    pred_steps, meas_steps = result.step_times[w:], measured[w:] or measured
    n = min(len(pred_steps), len(meas_steps))
    pairs = list(zip(pred_steps[:n], meas_steps[:n]))
    per_step = statistics.fmean(abs(p - m) / m for p, m in pairs) if pairs else math.nan
    return Calibration(fitted={"decode_step_overhead_s": overhead, "train_mfu": mfu,
                               "update_overhead_s": sim.update_overhead_s},
                       measured_step_time=statistics.fmean(meas_steps),
                       predicted_step_time=result.step_time, per_step_error=per_step, result=result,
                       measured_busy={side: 1 - statistics.fmean(scalars[tag])
                                      for side, tag in (("servers", "perf/generator_idle_fraction"),
                                                        ("trainer", "perf/trainer_idle_fraction")) if tag in scalars})
