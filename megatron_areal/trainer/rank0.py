"""Rank 0's duties besides training, behind one object: every other rank holds ``NoDuties``.

Rank 0 runs the rollout controller (a background asyncio thread that keeps the servers busy), the
reward pool, the held-out evaluation, the metrics and the ledger of trained samples. The training
loop calls the same methods on every rank; on the others they do nothing.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_areal.config import Config
from megatron_areal.records import Trajectory
from megatron_areal.rundir import timeline
from megatron_areal.rundir.layout import RunDir
from megatron_areal.rundir.ledger import TrainedLedger
from megatron_areal.trainer.run_timeline import EVALUATION, TRAINER

T = TypeVar("T")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_areal.data.prompt import Prompt
    from megatron_areal.fleet.fleet import Fleet
    from megatron_areal.reward import RewardService
    from megatron_areal.rollout.controller import RolloutController
    from megatron_areal.rundir.metrics import MetricsWriter
    from megatron_areal.weights.push import SyncResult, WeightSync

logger = logging.getLogger(__name__)

BATCH_TIMEOUT_S = 3600.0  # a batch that takes longer than this means the fleet is stuck


@dataclass(frozen=True)
class StepTimes:
    """Monotonic clock at the start of a step, once its batch was in, and once it was trained."""

    start: float
    batch_in: float
    trained: float


class NoDuties:
    """The duties of a rank other than 0: none (the loop calls the same methods everywhere)."""

    def start(self, step: int) -> None:
        """Nothing to start."""

    def take_batch(self) -> list[Trajectory] | None:
        """None: the batch comes from rank 0."""
        return None

    def hold_generation(self) -> None:
        """Nothing to hold."""

    def after_step(self, step: int, version: int, batch: list[Trajectory], stats: dict[str, float],
                   times: StepTimes, sync: SyncResult) -> None:
        """Nothing to record."""

    def rollout_state(self) -> dict[str, Any] | None:
        """None: rank 0 holds the rollout state."""
        return None

    def finish(self, step: int, stopped_on_request: bool) -> None:
        """Nothing to finish."""

    def close(self) -> None:
        """Nothing to close."""


@dataclass
class Rank0Duties:
    """Rank 0: the rollout controller, the reward pool, the tokenizer, the eval set, the metrics and
    the ledger. Rollouts and evaluation use the ``Fleet`` the weight path updates, so a server it
    drops gets no more rollouts or evaluations."""

    cfg: Config
    fleet: Fleet
    weights: WeightSync | None  # None until the policy is built (``attach``)
    controller: RolloutController
    rewards: RewardService
    tokenizer: PreTrainedTokenizerBase
    eval_prompts: list[Prompt]
    metrics: MetricsWriter
    ledger: TrainedLedger
    before: cf.Future[float | None] | None = field(default=None, repr=False)
    final_eval: cf.Future[float | None] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, cfg: Config, hf_dir: Path, fleet: Fleet, weights: WeightSync | None, version: int, step: int,
              rollout_state: dict | None) -> Rank0Duties:
        """Rank 0's duties for a run: tokenizer, datasets, reward pool, rollout controller (restored from
        ``rollout_state``), metrics and ledger."""
        from transformers import AutoTokenizer

        from megatron_areal.agent.from_config import episode_runner
        from megatron_areal.data.stream import PromptStream
        from megatron_areal.data.tasks import load_datasets
        from megatron_areal.data.template import encode_prompt
        from megatron_areal.reward import RewardService
        from megatron_areal.rollout.controller import RolloutController
        from megatron_areal.rundir.metrics import MetricsWriter

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        train_prompts, eval_prompts = load_datasets(cfg.data)
        stream = PromptStream(train_prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        rewards = RewardService(cfg.reward, tasks={p.task for p in train_prompts + eval_prompts})
        controller = RolloutController(
            cfg.rollout, cfg.staleness, fleet, stream,
            encode=lambda p: encode_prompt(tokenizer, p, cfg.data.chat_template),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            scorer=rewards, api_key=cfg.server.api_key, version=version,
            episodes=episode_runner(cfg.rollout, tokenizer, cfg.model.max_seq_len))
        if rollout_state is not None:
            controller.load_state_dict(rollout_state)
        metrics = MetricsWriter(cfg.train.run_dir, total_steps=cfg.train.steps, start_step=step,
                                tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
        ledger = TrainedLedger(RunDir.of(cfg).trained, resume_step=step)
        return cls(cfg, fleet, weights, controller, rewards, tokenizer, eval_prompts, metrics, ledger)

    def start(self, step: int) -> None:
        """Start generating, and evaluate the starting policy (or read back a resumed run's) in the
        background: the first step trains meanwhile, and its weight push waits for the evaluation
        (``hold_generation``), so the evaluation sees the starting weights."""
        self.controller.start()
        if self.before is None:
            self.evaluate_start(step)

    def evaluate_start(self, step: int) -> None:
        """Evaluate the starting policy (or read back a resumed run's result) in the background."""
        self.before = in_background(before_accuracy, self, step)

    def attach(self, weights: WeightSync) -> Rank0Duties:
        """The built policy's weight push (duties built before the policy); returns self."""
        self.weights = weights
        return self

    def take_batch(self) -> list[Trajectory]:
        """The next admissible batch from the rollout controller (blocks)."""
        return self.controller.get_batch(BATCH_TIMEOUT_S)

    def hold_generation(self) -> None:
        """Hold new groups and re-posts (the weight mover pauses the servers itself), once the starting
        policy's evaluation is done."""
        with timeline.activity(TRAINER, "waiting for evaluation"):
            self.before.result()
        self.controller.pause_generation(pause_servers=False)

    def after_step(self, step: int, version: int, batch: list[Trajectory], stats: dict[str, float],
                   times: StepTimes, sync: SyncResult) -> None:
        """Resume generation under the new version, record the trained prompts and the step's metrics,
        evaluate when due."""
        self.controller.resume_generation(version, resume_servers=False)
        self.ledger.record(step, version, batch)
        self.metrics.advance(step, step_metrics(stats, self.controller.metrics(), times, sync))
        every, steps = self.cfg.train.eval_every, self.cfg.train.steps
        if every and step % every == 0 and step < steps:
            with timeline.activity(TRAINER, "evaluating"):
                evaluate_held_out(self, step, "during")
        if step == steps:  # the final weights are on the servers: evaluate them while the trainer saves
            self.controller.stop()
            self.final_eval = in_background(evaluate_held_out, self, step, "after")

    def rollout_state(self) -> dict[str, Any]:
        """The rollout controller's state, for a checkpoint."""
        return self.controller.state_dict()

    def finish(self, step: int, stopped_on_request: bool) -> None:
        """Stop generating and evaluate the final policy (not when stopped to requeue); report servers lost
        or re-admitted."""
        if not stopped_on_request:  # a run stopped to requeue spends no time on the final eval
            self.controller.stop()
            with timeline.activity(TRAINER, "evaluating"):
                after = self.final_eval.result() if self.final_eval else evaluate_held_out(self, step, "after")
            before = self.before.result()
            if before is not None and after is not None:
                logger.info("held-out accuracy %.1f%% -> %.1f%% (%+.1f points) over %d steps", 100 * before,
                            100 * after, 100 * (after - before), step)
        w = self.weights
        if w is not None and (w.readmitted or w.lost):
            logger.warning("rollout servers: %d re-admitted after a restart (rollout/server_restarts), %d still "
                           "out at the end%s", w.readmitted, len(w.lost),
                           f" ({', '.join(w.lost)})" if w.lost else "")

    def close(self) -> None:
        """Stop the controller, the reward pool and the metrics writer."""
        self.controller.stop()
        self.rewards.close()
        self.metrics.close()


def evaluate_held_out(duties: Rank0Duties, step: int, label: str) -> float | None:
    """Accuracy on the held-out prompts with the servers' current weights, logged and recorded."""
    from megatron_areal.evaluation.held_out import evaluate
    from megatron_areal.rundir.metrics import append_eval

    cfg = duties.cfg
    if not duties.eval_prompts:
        return None
    with timeline.activity(EVALUATION, "evaluating"):
        if cfg.rollout.workflow:  # agent episodes: whole episodes played greedily, scored by the agent
            from megatron_areal.evaluation.agent import evaluate_episodes
            result = evaluate_episodes(duties.fleet, cfg.rollout, duties.tokenizer, duties.eval_prompts,
                                       cfg.model.max_seq_len)
        else:
            result = evaluate(duties.fleet, duties.eval_prompts, duties.tokenizer, duties.rewards,
                              max_new_tokens=cfg.rollout.max_new_tokens, chat_template=cfg.data.chat_template)
    duties.metrics.log(step, result.as_metrics())
    logger.info("eval %s (step %d): accuracy %.1f%% on %d held-out prompts of %s (%.0f s)", label, step,
                100 * result.accuracy, result.n, cfg.data.eval, result.seconds)
    if hasattr(result, "tool_use"):
        logger.info("eval %s (step %d): the model called a tool in %.1f%% of the episodes", label, step,
                    100 * result.tool_use)
    # "time": the wall clock (Unix seconds) when the result was known, so a benchmark reads the time to
    # an accuracy level on the same clock as a baseline's (bench/time_to_accuracy.py)
    append_eval(cfg.train.run_dir, {"step": step, "label": label, "accuracy": result.accuracy, "n": result.n,
                                    "time": time.time()})
    return result.accuracy


def in_background(fn: Callable[..., T], *args: Any) -> cf.Future[T]:
    """``fn(*args)`` on a thread of its own; its result (or error) waits in the future."""
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix=fn.__name__)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


def before_accuracy(duties: Rank0Duties, step: int) -> float | None:
    """The base model's held-out accuracy, for the closing before -> after summary: a run starting
    at step 0 evaluates it; a resumed run reads back what its first run recorded in eval.jsonl."""
    from megatron_areal.rundir.metrics import read_eval

    if step == 0:
        return evaluate_held_out(duties, step, "before")
    return read_eval(duties.cfg.train.run_dir, "before")


def step_metrics(stats: dict[str, float], rollout: dict[str, float], times: StepTimes,
                 sync: SyncResult) -> dict[str, float]:
    """The scalars logged for one step: the actor's statistics, the rollout figures, throughput and time split."""
    step_s = time.monotonic() - times.start
    wait_s, train_s = times.batch_in - times.start, times.trained - times.batch_in
    out = {f"train/{k}": v for k, v in stats.items() if k != "tokens_per_s"}
    out.update(rollout)
    out.update({
        # trained (loss) tokens per second of wall time (the run's throughput), and while computing
        "perf/train_tokens_per_s": stats.get("tokens", 0.0) / max(step_s, 1e-9),
        "perf/train_compute_tokens_per_s": stats.get("tokens", 0.0) / max(train_s, 1e-9),
        # every token the actor computed on (prompts included) per second of its update
        "perf/train_all_tokens_per_s": stats.get("tokens_per_s", 0.0),
        "perf/trainer_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        "perf/weight_sync_s": sync.seconds,
        "perf/weight_sync_mb": sync.bytes_sent / 1e6,
        # bytes one server received in this step's push (all stages): whole weights, or a model.lora run's adapters
        "weights/bytes_pushed": float(sync.bytes_sent),
        "perf/step_time_s": step_s,
        "perf/batch_wait_s": wait_s,
        "perf/trainer_idle_fraction": wait_s / max(step_s, 1e-9),
    })
    if sync.verified_tensors is not None:  # weights.verify: the (server, tensor) checksums that agreed
        out["weights/verified_tensors"] = float(sync.verified_tensors)
    return out
