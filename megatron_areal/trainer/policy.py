"""``Policy``: what every trainer rank holds of the model being trained.

The Megatron actor (loaded from the HF folder, or resumed from the newest checkpoint), its
checkpoints, and the weight push to the rollout servers; ``step`` and ``version`` say where
training stands. All methods are collective over the trainer's ranks. On rank 0 the weight push
goes through the ``Fleet`` that rank 0's rollouts and evaluation share (``fleet``; None elsewhere).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_areal.config import Config
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.records import Trajectory
from megatron_areal.run.control import ask_to_resume
from megatron_areal.rundir.layout import RunDir
from megatron_areal.util.heap import release_freed_memory

if TYPE_CHECKING:
    from megatron_areal.actor.actor import Actor
    from megatron_areal.checkpoint.training import Checkpointer
    from megatron_areal.weights.push import SyncResult, WeightSync

logger = logging.getLogger(__name__)

RolloutState = Callable[[], "dict[str, Any] | None"]  # rank 0's controller state; None elsewhere


def open_fleet(cfg: Config, server_urls: list[str]) -> Fleet:
    """Rank 0's connections to the rollout servers, shared by rollouts, evaluation and the weight push."""
    return Fleet(server_urls, api_key=cfg.server.api_key, request_timeout_s=cfg.rollout.request_timeout_s,
                 control_timeout_s=cfg.weights.timeout_s, engine=cfg.server.engine)


@dataclass
class Policy:
    """The trained model on one rank: actor, checkpoints and weight push, at ``step`` / ``version``."""

    cfg: Config
    actor: Actor
    checkpoints: Checkpointer
    weights: WeightSync
    run_dir: RunDir
    hf_dir: Path
    fleet: Fleet | None = None  # rank 0: the rollout servers, shared with the rollouts and evaluation
    step: int = 0
    version: int = 0
    rollout_state: dict[str, Any] | None = None  # the controller state the checkpoint resumed
    saved_step: int = 0

    @classmethod
    def build(cls, cfg: Config, server_urls: list[str], fleet: Fleet | None) -> Policy:
        """Process groups, the actor with the HF weights, the newest checkpoint (when resuming) and the
        weight push; servers get the resumed weights before the first rollout. Rank 0 pushes through
        ``fleet``, the one its rollouts and evaluation use (``loop.run_trainer`` opens it); None elsewhere."""
        from megatron_areal.actor.actor import Actor
        from megatron_areal.actor.parallel import init_parallel
        from megatron_areal.checkpoint.training import Checkpointer
        from megatron_areal.model.arch import load_arch
        from megatron_areal.model.assets import resolve_model
        from megatron_areal.model.weights import load_hf_weights
        from megatron_areal.weights.push import WeightSync

        groups = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed, backend=cfg.parallel.backend,
                               ep=cfg.parallel.ep, etp=cfg.parallel.etp)
        hf_dir = resolve_model(cfg.model.path)
        arch = load_arch(hf_dir)
        actor = Actor(arch, cfg.model, cfg.parallel, cfg.optimizer, cfg.ppo, groups, seed=cfg.train.seed,
                      total_steps=cfg.train.steps)
        load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer,
                        etp_rank=groups.etp_rank, etp_size=groups.etp)
        if cfg.ppo.kl_coef > 0:
            actor.set_reference()
        run_dir = RunDir.of(cfg)
        checkpoints = Checkpointer(run_dir.checkpoints, arch, groups, keep=cfg.checkpoint.keep, hf_dir=hf_dir)
        step, extra = 0, {}
        latest = checkpoints.latest() if cfg.checkpoint.resume else None
        if latest is not None:
            step, extra = checkpoints.load(latest, actor.model, actor.optimizer, actor.scheduler)
        version = int(extra.get("version", 0))
        weights = WeightSync(actor.model, arch, groups, server_urls, config=cfg.weights, server_tp=cfg.server.tp,
                             api_key=cfg.server.api_key, template_dir=hf_dir, fleet=fleet, engine=cfg.server.engine)
        if version > 0:  # the servers started from the base model: give them the resumed policy first
            weights.sync(version)
        return cls(cfg, actor, checkpoints, weights, run_dir, hf_dir, fleet, step=step, version=version,
                   rollout_state=extra.get("rollout"), saved_step=step)

    @property
    def done(self) -> bool:
        """Whether every configured step is trained."""
        return self.step >= self.cfg.train.steps

    def train(self, batch: list[Trajectory]) -> dict[str, float]:
        """One PPO update on ``batch`` (collective); returns the step's statistics."""
        stats = self.actor.ppo_update(batch, self.cfg.rollout.temperature, version=self.version)
        release_freed_memory()  # the step's activations, or the heap keeps the busiest step's size
        return stats

    def push(self, rollout_state: RolloutState) -> SyncResult:
        """Push the trained weights as ``version + 1`` and advance. A failed push saves the trained
        step first (it is sound; only the push failed); one lost over NCCL also asks the Slurm
        batch step to requeue the job."""
        from megatron_areal.weights.push import TransferLost, WeightSyncError

        try:
            sync = self.weights.sync(self.version + 1)
        except WeightSyncError as e:
            self.save(rollout_state, at=(self.step + 1, self.version + 1))
            if dist.get_rank() == 0 and isinstance(e, TransferLost):
                ask_to_resume(self.run_dir.root, self.step + 1, str(e))
            raise
        self.step, self.version = self.step + 1, self.version + 1
        return sync

    def checkpoint_due(self) -> bool:
        """Whether this step is a checkpoint step (``checkpoint.every``, and always the last)."""
        every = self.cfg.checkpoint.every
        return bool(every) and (self.step % every == 0 or self.done)

    def save(self, rollout_state: RolloutState, at: tuple[int, int] | None = None) -> None:
        """Every rank saves ``at`` = (step, version), by default the current ones, once (a checkpoint
        request right after a periodic save reuses it); rank 0's rollout state goes to all ranks."""
        step, version = at or (self.step, self.version)
        if self.saved_step == step:
            return
        payload = [rollout_state()]
        dist.broadcast_object_list(payload, src=0)  # every rank writes the same common state
        self.checkpoints.save(step, self.actor.model, self.actor.optimizer, self.actor.scheduler,
                              extra={"version": version, "rollout": payload[0]})
        release_freed_memory()
        self.saved_step = step

    def close(self) -> None:
        """Close the weight path and the fleet, then leave the process group."""
        self.weights.close()
        if self.fleet is not None:
            self.fleet.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
