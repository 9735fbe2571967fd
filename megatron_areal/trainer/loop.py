"""The training loop every trainer rank runs.

    take the oldest admissible batch -> proximal logprobs -> advantages -> decoupled-PPO updates
    -> push weights to the fleet -> version + 1

Rank 0's extra duties (rollouts, rewards, evaluation, metrics) sit behind ``duties``; on the
other ranks that object does nothing, so the loop has no rank branches.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist

from megatron_areal.config import Config
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.records import Trajectory
from megatron_areal.run.control import StepControl
from megatron_areal.rundir import timeline
from megatron_areal.trainer import run_timeline
from megatron_areal.trainer.policy import Policy, open_fleet
from megatron_areal.trainer.rank0 import NoDuties, Rank0Duties, StepTimes
from megatron_areal.trainer.run_timeline import TRAINER


def run_trainer(cfg: Config, server_urls: list[str]) -> None:
    """One trainer rank's whole run: build the policy (and on rank 0 its duties), then per step take a batch,
    train, push the weights, checkpoint when due, and stop early when the run directory asks."""
    # rank 0's one connection to the servers, shared by its rollouts, evaluation and the weight push
    # (read from the environment: the process group does not exist yet)
    fleet = open_fleet(cfg, server_urls) if os.environ.get("RANK", "0") == "0" else None
    early = evaluate_while_loading(cfg, fleet)
    try:
        with timeline.activity(TRAINER, "loading model"):
            policy = Policy.build(cfg, server_urls, fleet)
    except BaseException:
        if fleet is not None:  # the fleet's close ends the evaluation's requests
            fleet.close()
        if early:
            early.close()
        raise
    rank0 = dist.get_rank() == 0
    if early:
        duties = early.attach(policy.weights)
    else:
        with timeline.activity(TRAINER, "preparing rollouts"):
            duties = Rank0Duties.build(cfg, policy.hf_dir, policy.fleet, policy.weights, policy.version, policy.step,
                                       policy.rollout_state) if rank0 else NoDuties()
    control = StepControl(policy.run_dir.root, rank0, agree=from_rank0)
    stopped_on_request = False
    timeline.set_state(TRAINER, "between steps")  # what no phase below claims: the loop's own overhead
    try:
        duties.start(policy.step)
        while not policy.done:
            start = time.monotonic()
            with timeline.activity(TRAINER, "waiting for batch"):
                batch = broadcast_batch(duties.take_batch())
            batch_in = time.monotonic()
            with timeline.activity(TRAINER, "training"):
                stats = policy.train(batch)
            times = StepTimes(start, batch_in, time.monotonic())
            duties.hold_generation()
            with timeline.activity([TRAINER, *timeline.server_roles()], "weight update"):
                sync = policy.push(duties.rollout_state)
            duties.after_step(policy.step, policy.version, batch, stats, times, sync)
            if policy.checkpoint_due():
                with timeline.activity(TRAINER, "checkpointing"):
                    policy.save(duties.rollout_state)
            if not policy.done and control.stop_after(policy.step, save=lambda: policy.save(duties.rollout_state)):
                stopped_on_request = True
                break
        duties.finish(policy.step, stopped_on_request)
    finally:
        timeline.set_state(TRAINER, "closing")
        duties.close()
        policy.close()
        run_timeline.finish(policy.run_dir)


def evaluate_while_loading(cfg: Config, fleet: Fleet | None) -> Rank0Duties | None:
    """On rank 0 of a fresh run (the one holding ``fleet``): rank 0's duties built before the model, with the
    starting policy's held-out evaluation under way on the servers, which would otherwise idle while the
    trainer loads the model (a resumed run's servers get its weights first, so it evaluates after loading,
    as before). None elsewhere."""
    from megatron_areal.checkpoint.training import list_checkpoints
    from megatron_areal.model.assets import resolve_model
    from megatron_areal.rundir.layout import RunDir

    if fleet is None:
        return None
    if cfg.checkpoint.resume and list_checkpoints(RunDir.of(cfg).checkpoints):
        return None
    with timeline.activity(TRAINER, "preparing rollouts"):
        duties = Rank0Duties.build(cfg, resolve_model(cfg.model.path), fleet, None, 0, 0, None)
    duties.evaluate_start(0)
    return duties


def broadcast_batch(batch: list[Trajectory] | None, src: int = 0) -> list[Trajectory]:
    """Give every rank the batch that rank 0 took (each rank then packs its own DP share)."""
    payload = [[t.to_dict() for t in batch] if batch is not None else None]
    dist.broadcast_object_list(payload, src=src)
    return [Trajectory.from_dict(d) for d in payload[0]]


def from_rank0(decision: str | None) -> str:
    """Rank 0's decision at a step boundary, on every rank."""
    payload = [decision]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]
