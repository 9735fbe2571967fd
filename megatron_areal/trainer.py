"""The training loop run by every trainer rank.

    take the oldest admissible batch -> proximal logprobs -> advantages -> decoupled-PPO updates
    -> push weights to the fleet -> version + 1

Rank 0 also runs the rollout controller (a background asyncio thread that keeps the servers
busy), the reward pool, evaluation, metrics and the progress bar. Every other rank only trains
and helps move weights.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_areal.config import Config
from megatron_areal.launch.control import StepControl, ask_to_resume
from megatron_areal.ledger import TrainedLedger
from megatron_areal.rollout.trajectory import Trajectory
from megatron_areal.rundir import RunDir

logger = logging.getLogger(__name__)

BATCH_TIMEOUT_S = 3600.0  # a batch that takes longer than this means the fleet is stuck


@dataclass
class RolloutSide:
    """What only rank 0 holds: the controller, the reward pool, the tokenizer, the eval set."""

    controller: Any
    rewards: Any
    tokenizer: Any
    eval_prompts: list
    metrics: Any
    ledger: TrainedLedger

    def close(self) -> None:
        self.controller.stop()
        self.rewards.close()
        self.metrics.close()


def broadcast_batch(batch: list[Trajectory] | None, src: int = 0) -> list[Trajectory]:
    """Give every rank the batch that rank 0 took (each rank then packs its own DP share)."""
    payload = [[t.to_dict() for t in batch] if batch is not None else None]
    dist.broadcast_object_list(payload, src=src)
    return [Trajectory.from_dict(d) for d in payload[0]]


def _rollout_side(cfg: Config, hf_dir: Path, server_urls: list[str], version: int, start_step: int,
                  rollout_state: dict | None) -> RolloutSide:
    from transformers import AutoTokenizer

    from megatron_areal.data.stream import PromptStream
    from megatron_areal.data.tasks import load_datasets
    from megatron_areal.data.template import encode_prompt
    from megatron_areal.metrics import MetricsWriter
    from megatron_areal.reward import RewardService
    from megatron_areal.rollout.controller import RolloutController

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    train_prompts, eval_prompts = load_datasets(cfg.data)
    stream = PromptStream(train_prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    rewards = RewardService(cfg.reward, tasks={p.task for p in train_prompts + eval_prompts})
    controller = RolloutController(
        cfg.rollout, cfg.staleness, server_urls, stream,
        encode=lambda p: encode_prompt(tokenizer, p, cfg.data.chat_template),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        scorer=rewards, api_key=cfg.server.api_key, version=version)
    if rollout_state is not None:
        controller.load_state_dict(rollout_state)
    metrics = MetricsWriter(cfg.train.run_dir, total_steps=cfg.train.steps, start_step=start_step,
                            tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
    ledger = TrainedLedger(RunDir.of(cfg).trained, resume_step=start_step)
    return RolloutSide(controller, rewards, tokenizer, eval_prompts, metrics, ledger)


def _evaluate(side: RolloutSide, cfg: Config, server_urls: list[str], step: int, label: str) -> float | None:
    from megatron_areal.evaluate import evaluate
    from megatron_areal.metrics import append_eval

    if not side.eval_prompts:
        return None
    result = evaluate(server_urls, side.eval_prompts, side.tokenizer, side.rewards,
                      max_new_tokens=cfg.rollout.max_new_tokens, chat_template=cfg.data.chat_template,
                      api_key=cfg.server.api_key)
    side.metrics.log(step, result.as_metrics())
    logger.info("eval %s (step %d): accuracy %.1f%% on %d held-out prompts of %s (%.0f s)", label, step,
                100 * result.accuracy, result.n, cfg.data.eval, result.seconds)
    append_eval(cfg.train.run_dir, {"step": step, "label": label, "accuracy": result.accuracy, "n": result.n})
    return result.accuracy


def _before_accuracy(side: RolloutSide, cfg: Config, server_urls: list[str], step: int) -> float | None:
    """The base model's held-out accuracy, for the closing before -> after summary: a run starting
    at step 0 evaluates it; a resumed run reads back what its first run recorded in eval.jsonl."""
    from megatron_areal.metrics import read_eval

    if step == 0:
        return _evaluate(side, cfg, server_urls, step, "before")
    return read_eval(cfg.train.run_dir, "before")


def _step_metrics(stats: dict[str, float], rollout: dict[str, float], wait_s: float, train_s: float,
                  sync: Any, step_s: float) -> dict[str, float]:
    out = {f"train/{k}": v for k, v in stats.items() if k != "tokens_per_s"}
    out.update(rollout)
    out.update({
        # trained tokens per second of wall time (the run's throughput), and while computing
        "perf/train_tokens_per_s": stats.get("tokens", 0.0) / max(step_s, 1e-9),
        "perf/train_compute_tokens_per_s": stats.get("tokens", 0.0) / max(train_s, 1e-9),
        "perf/weight_sync_s": sync.seconds,
        "perf/weight_sync_mb": sync.bytes_sent / 1e6,
        "perf/step_time_s": step_s,
        "perf/batch_wait_s": wait_s,
        "perf/trainer_idle_fraction": wait_s / max(step_s, 1e-9),
    })
    return out


def _agree(decision: str | None) -> str:
    """Rank 0's decision at a step boundary, on every rank."""
    payload = [decision]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def run_trainer(cfg: Config, server_urls: list[str]) -> None:
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.assets import resolve_model
    from megatron_areal.convert.arch import load_arch
    from megatron_areal.convert.checkpoint import Checkpointer
    from megatron_areal.convert.weights import load_hf_weights
    from megatron_areal.realloc.sync import TransferLost, WeightSync, WeightSyncError

    groups = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed, backend=cfg.parallel.backend)
    rank0 = dist.get_rank() == 0
    hf_dir = resolve_model(cfg.model.path)
    arch = load_arch(hf_dir)
    actor = Actor(arch, cfg.model, cfg.parallel, cfg.optimizer, cfg.ppo, groups, seed=cfg.train.seed,
                  total_steps=cfg.train.steps)
    load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
    if cfg.ppo.kl_coef > 0:
        actor.set_reference()

    run_dir = RunDir.of(cfg)
    checkpoints = Checkpointer(run_dir.checkpoints, arch, groups, keep=cfg.checkpoint.keep, hf_dir=hf_dir)
    step, extra = 0, {}
    latest = checkpoints.latest() if cfg.checkpoint.resume else None
    if latest is not None:
        step, extra = checkpoints.load(latest, actor.model, actor.optimizer, actor.scheduler)
    version = int(extra.get("version", 0))

    weights = WeightSync(actor.model, arch, groups, server_urls, config=cfg.realloc, server_tp=cfg.server.tp,
                         api_key=cfg.server.api_key, template_dir=hf_dir)
    if version > 0:  # the servers started from the base model: give them the resumed policy first
        weights.sync(version)

    # the fleet is what the weight path holds: a server it drops gets no rollouts or evaluations
    side = _rollout_side(cfg, hf_dir, list(weights.servers), version, step, extra.get("rollout")) if rank0 else None
    before = _before_accuracy(side, cfg, list(weights.servers), step) if rank0 else None
    if rank0:
        side.controller.start()
        weights.on_drop = side.controller.drop_server
        weights.on_join = side.controller.add_server  # a dropped server back (restarted), with current weights
    saved_at = {"step": step}

    def save_checkpoint(at: int, version: int) -> None:
        """Every rank saves step ``at`` once (a checkpoint request right after a periodic save reuses it)."""
        if saved_at["step"] == at:
            return
        payload = [side.controller.state_dict() if rank0 else None]
        dist.broadcast_object_list(payload, src=0)  # every rank writes the same common state
        checkpoints.save(at, actor.model, actor.optimizer, actor.scheduler,
                         extra={"version": version, "rollout": payload[0]})
        saved_at["step"] = at

    control = StepControl(run_dir.root, rank0, agree=_agree)
    stopped_on_request = False
    try:
        while step < cfg.train.steps:
            t0 = time.monotonic()
            batch = broadcast_batch(side.controller.get_batch(BATCH_TIMEOUT_S) if rank0 else None)
            t1 = time.monotonic()
            stats = actor.ppo_update(batch, cfg.rollout.temperature, version=version)
            t2 = time.monotonic()
            if rank0:  # hold new groups and re-posts; the weight mover pauses the servers itself
                side.controller.pause_generation(pause_servers=False)
            try:
                sync = weights.sync(version + 1)
            except WeightSyncError as e:
                save_checkpoint(step + 1, version + 1)  # the trained step is sound; only the push failed
                if rank0 and isinstance(e, TransferLost):
                    ask_to_resume(run_dir.root, step + 1, str(e))  # the Slurm batch step requeues the job
                raise
            version, step = version + 1, step + 1
            if rank0:
                side.controller.resume_generation(version, resume_servers=False)
                side.ledger.record(step, version, batch)
                side.metrics.advance(step, _step_metrics(stats, side.controller.metrics(), t1 - t0, t2 - t1, sync,
                                                         time.monotonic() - t0))
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                    _evaluate(side, cfg, list(weights.servers), step, "during")
            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
                save_checkpoint(step, version)
            if step < cfg.train.steps and control.stop_after(step, save=partial(save_checkpoint, step, version)):
                stopped_on_request = True
                break
        if rank0 and not stopped_on_request:  # a run stopped to requeue spends no time on the final eval
            side.controller.stop()
            after = _evaluate(side, cfg, list(weights.servers), step, "after")
            if before is not None and after is not None:
                logger.info("held-out accuracy %.1f%% -> %.1f%% (%+.1f points) over %d steps", 100 * before,
                            100 * after, 100 * (after - before), step)
        if rank0 and (weights.readmitted or weights.lost):
            logger.warning("rollout servers: %d re-admitted after a restart (rollout/server_restarts), %d still "
                           "out at the end%s", weights.readmitted, len(weights.lost),
                           f" ({', '.join(weights.lost)})" if weights.lost else "")
    finally:
        if rank0:
            side.close()
        weights.close()
        if dist.is_initialized():
            dist.barrier()
        torch.distributed.destroy_process_group()
