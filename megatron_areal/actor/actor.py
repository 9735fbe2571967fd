"""The Megatron actor: logprobs of token sequences, and decoupled-PPO updates.

Loss scaling across micro-batches and DP ranks. The objective of one mini-batch is the mean of the
per-token PPO loss over all loss-mask tokens of the mini-batch, ``N``, wherever they were
computed. Every rank sees the whole trajectory list, so ``N`` is known locally. Each micro-batch
passes ``loss_scale_tokens=N`` to ``PPOObjective`` (its share of the sum divided by ``N``);
Megatron's schedule then divides by the number of micro-batches ``M`` and Megatron DDP averages
gradients over the ``D`` DP ranks, so the micro-batch returns ``loss * M * D`` and the gradient is
exactly that of the mini-batch mean. The reported ``loss`` is the sum of the unscaled pieces.

Where results live: logprobs come out of the last pipeline stage (identical on its TP ranks);
``compute_logprobs`` all-reduces them over the model-parallel and DP groups, so every rank returns
the logprobs of every sequence. ``ppo_update`` statistics are reduced the same way and returned on
every rank.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_areal.actor.attention import PackedCoreAttention
from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_areal.actor.engine import run_microbatches
from megatron_areal.actor.lora import attach_lora
from megatron_areal.actor.microbatch import PackedMicroBatch, pack
from megatron_areal.actor.model import build_model, check_layout, resolve_dtype
from megatron_areal.actor.moe_metrics import take_aux_loss
from megatron_areal.actor.optim import build_train_state, current_lr
from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.actor.ppo_batch import (
    StatsReducer,
    check_trajectories,
    fresh_token_mask,
    sequence_advantages,
    token_advantages,
)
from megatron_areal.actor.routing_replay import RouteHook, decode_routes, pack_routes
from megatron_areal.actor.shared_prefix import Unit, fit_to_budget, prefix_units
from megatron_areal.algorithm import PPOObjective, kl_penalty
from megatron_areal.algorithm.config import PPOConfig
from megatron_areal.algorithm.offpolicy import rollout_mismatch_metrics
from megatron_areal.data.packing import allocate_microbatches, check_lengths, kk_partition
from megatron_areal.model.arch import ModelArch
from megatron_areal.records import Trajectory

log = logging.getLogger(__name__)


class Actor:
    """Policy model sharded over ``groups``; ``model``/``optimizer``/``scheduler`` are public for
    checkpointing and weight transfer."""

    def __init__(self, arch: ModelArch, model_cfg: ModelConfig, parallel_cfg: ParallelConfig,
                 optimizer_cfg: OptimizerConfig, ppo_cfg: PPOConfig, groups: ParallelGroups, *,
                 seed: int = 1, total_steps: int = 1000) -> None:
        wanted = (parallel_cfg.tp, parallel_cfg.pp, parallel_cfg.ep, parallel_cfg.etp)
        if wanted != (groups.tp, groups.pp, groups.ep, groups.etp):
            raise ValueError(f"parallel config tp={parallel_cfg.tp} pp={parallel_cfg.pp} ep={parallel_cfg.ep} "
                             f"etp={parallel_cfg.etp} does not match the initialised groups tp={groups.tp} "
                             f"pp={groups.pp} ep={groups.ep} etp={groups.etp}")
        check_layout(arch, groups.tp, groups.pp, groups.ep, groups.etp)
        if arch.is_moe and groups.tp > 1 and not parallel_cfg.sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel must be true for a MoE model at parallel.tp={groups.tp}: "
                             "megatron-core's MoE layer refuses to train tensor-parallel without it")
        if arch.is_moe and model_cfg.recompute_activations:
            raise ValueError("model.recompute_activations is not supported for MoE models: the backward would "
                             "route the recomputed layers again, outside the rollout's routing replay")
        self.arch, self.model_cfg, self.parallel_cfg = arch, model_cfg, parallel_cfg
        self.ppo_cfg, self.groups = ppo_cfg, groups
        self.objective = PPOObjective.from_config(ppo_cfg)  # the loss and its corrections, built once
        self.dtype = self._dtype(model_cfg.dtype, groups)
        chunks = build_model(arch, groups, sequence_parallel=parallel_cfg.sequence_parallel, dtype=self.dtype,
                             seed=seed, transformer_impl=model_cfg.transformer_impl,
                             aux_loss_coef=model_cfg.router_aux_loss_coef, recompute=model_cfg.recompute_activations)
        if model_cfg.lora.enabled:  # before DDP: only the adapters get gradient buffers and optimizer state
            attach_lora(chunks, arch, model_cfg.lora, tp=groups.tp, tp_rank=groups.tp_rank, seed=seed,
                        sequence_parallel=parallel_cfg.sequence_parallel, recompute=model_cfg.recompute_activations)
        state = build_train_state(chunks, optimizer_cfg, groups, total_steps * ppo_cfg.n_minibatches)
        self.model, self.optimizer, self.scheduler = state.model, state.optimizer, state.scheduler
        # shared prompt tokens need the local spec's attention (parallel.share_prompts)
        self._packed_attention = any(isinstance(m, PackedCoreAttention) for c in chunks for m in c.modules())
        self._reference: list[torch.Tensor] | None = None

    @staticmethod
    def _dtype(name: str, groups: ParallelGroups) -> torch.dtype:
        return resolve_dtype(name, groups.device)

    # ---------------------------------------------------------------- packing
    def _plan(self, sequences: Sequence[Sequence[int]], min_microbatches: int,
              values: dict[str, Sequence[Sequence[float]]] | None = None,
              routes: Sequence[torch.Tensor] | None = None) -> list[PackedMicroBatch]:
        """This DP rank's packed micro-batches (same count on every DP rank); ``routes``: each
        sequence's rollout experts ``[L - 1, layers, top_k]`` (MoE, routing_replay.py)."""
        lengths = [len(s) for s in sequences]
        for i, n in enumerate(lengths):
            if n < 2:
                raise ValueError(f"sequence {i} has {n} token(s); a logprob needs at least 2")
        budget = self.parallel_cfg.max_tokens_per_mb
        check_lengths(lengths, budget, self.model_cfg.max_seq_len)
        ids = range(len(sequences))
        if self.parallel_cfg.share_prompts and not self.arch.is_moe and self._packed_attention:
            units = fit_to_budget(prefix_units(sequences, ids, (values or {}).get("loss_mask")), lengths, budget)
        else:  # MoE models (untested with shared tokens) and the TE attention keep each sequence whole
            units = [Unit((i,)) for i in ids]
        plan = allocate_microbatches([u.n_tokens(lengths) for u in units], budget, self.groups.dp,
                                     min_microbatches, self.parallel_cfg.packing)
        multiple = math.lcm(self.parallel_cfg.mb_token_multiple,
                            self.groups.tp if self.parallel_cfg.sequence_parallel else 1)
        batches = [pack(sequences, [units[k] for k in ks], multiple, values) for ks in plan[self.groups.dp_rank]]
        if routes is not None:
            for mb in batches:
                mb.routes = pack_routes(routes, mb.seq_ids, mb.value_index, mb.n_tokens, self.arch.num_layers,
                                        self.arch.num_experts_per_tok)
        return batches

    def _gather(self, sequences: Sequence[Sequence[int]], batches: list[PackedMicroBatch],
                reports: list[dict[str, Any]], keys: tuple[str, ...]) -> list[list[torch.Tensor]]:
        """Per-sequence vectors from the last stage's reports, all-reduced onto every rank."""
        starts = [0]
        for s in sequences:
            starts.append(starts[-1] + len(s) - 1)
        buf = torch.zeros(len(keys), starts[-1], dtype=torch.float32, device=self.groups.device)
        if self.groups.is_last_stage and self.groups.tp_rank == 0:
            for mb, rep in zip(batches, reports):
                for row, key in enumerate(keys):
                    for i, vals in zip(mb.seq_ids, mb.split(rep[key])):
                        buf[row, starts[i]:starts[i + 1]] = vals
        for g in (self.groups.mp_group, self.groups.dp_group):
            if dist.get_world_size(g) > 1:
                dist.all_reduce(buf, group=g)
        buf = buf.cpu()
        return [[buf[row, starts[i]:starts[i + 1]] for i in range(len(sequences))] for row in range(len(keys))]

    # ---------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, sequences: Sequence[Sequence[int]], temperature: float = 1.0,
                         with_entropy: bool = False, *, routes: Sequence[torch.Tensor] | None = None,
                         route_hook: RouteHook | None = None) -> list[torch.Tensor] | tuple[list[torch.Tensor], ...]:
        """Logprob of token t given tokens < t (L - 1 values per sequence), on every rank.

        MoE: ``routes`` and ``route_hook`` replay (or record and compare) the rollout's experts.
        """
        if not sequences:
            return ([], []) if with_entropy else []
        batches = self._plan(sequences, 1, routes=routes)

        def collect(mb: PackedMicroBatch, lp: torch.Tensor, ent: torch.Tensor):
            return lp.sum() * 0.0, {"logprobs": lp.detach().float(), "entropy": ent.detach().float()}

        for chunk in self.model:
            chunk.eval()
        try:
            reports = run_microbatches(self.model, batches, self.groups, vocab_size=self.arch.vocab_size,
                                       temperature=temperature, loss_fn=collect, forward_only=True,
                                       route_hook=route_hook if routes is not None else None)
        finally:
            for chunk in self.model:
                chunk.train()
        logprobs, entropy = self._gather(sequences, batches, reports, ("logprobs", "entropy"))
        return (logprobs, entropy) if with_entropy else logprobs

    # ---------------------------------------------------------------- reference policy (KL)
    def set_reference(self) -> None:
        """Snapshot the current weights as the KL reference policy."""
        self._reference = [p.detach().clone() for c in self.model for p in c.parameters()]

    @torch.no_grad()
    def _reference_logprobs(self, sequences: Sequence[Sequence[int]], temperature: float,
                            **routing: Any) -> list[torch.Tensor]:
        if self._reference is None:
            self.set_reference()
        params = [p for c in self.model for p in c.parameters()]
        current = [p.detach().clone() for p in params]
        for p, r in zip(params, self._reference):
            p.copy_(r)
        try:
            return self.compute_logprobs(sequences, temperature, **routing)
        finally:
            for p, c in zip(params, current):
                p.copy_(c)

    # ---------------------------------------------------------------- PPO
    def ppo_update(self, trajectories: Sequence[Trajectory], temperature: float = 1.0,
                   version: int | None = None) -> dict[str, float]:
        """Recompute proximal logprobs (a no-grad forward, skipped with a single mini-batch where the
        training forward yields them), compute advantages, run ``ppo.n_minibatches`` optimizer steps.

        Every rank passes the same full list. Returns, on every rank: ``loss``, ``clip_fraction``,
        ``importance_weight_mean``, ``entropy``, ``kl``, ``grad_norm`` (means over mini-batches),
        ``importance_weight_max``, ``tokens`` (loss tokens), ``dropped_tokens``, ``lr`` (after the
        update), ``n_microbatches`` (per DP rank) and ``tokens_per_s`` (all tokens over the wall time
        of the whole update, proximal recompute included), ``truncated_tokens`` and
        ``dropped_sequences`` (``ppo:`` corrections, algorithm/offpolicy.py); MoE models with the
        router's load-balancing loss on add ``moe_aux_loss`` (its value without the coefficient,
        mean over layers and micro-batches, actor/moe_metrics.py).

        Mismatch metrics (algorithm/offpolicy.py ``rollout_mismatch_metrics``): the trainer's
        logprobs under the weights it holds at the start of the update (pi_prox; with naive PPO and
        several mini-batches, only the first mini-batch has them) against the behaviour logprobs:
        ``rollout_mismatch_abs`` / ``rollout_mismatch_kl`` (k3) over the tokens whose per-token
        version equals ``version`` (the trainer's current policy version; None: the newest token
        version in the batch), ``rollout_mismatch_tokens`` their count, and
        ``behav_imp_weight_p50/p90/p99/max`` over all loss tokens.
        """
        start = time.perf_counter()
        cfg = self.ppo_cfg
        check_trajectories(trajectories, self.model_cfg.max_seq_len)
        if len(trajectories) < cfg.n_minibatches:
            raise ValueError(f"ppo.n_minibatches={cfg.n_minibatches} needs at least that many trajectories, "
                             f"got {len(trajectories)}")
        sequences = [t.input_ids for t in trajectories]
        behaviour = [t.behavior_logprobs for t in trajectories]
        values: dict[str, Sequence[Sequence[float]]] = {
            "loss_mask": [[float(m) for m in t.loss_mask] for t in trajectories],
            "behaviour": behaviour,
            "advantages": token_advantages(trajectories, sequence_advantages(trajectories, cfg.advantage),
                                           cfg.normalize_batch_advantage)}
        routes = self._rollout_routes(trajectories)
        record_pending = True  # the routing mismatch is measured on the first forward with pi_prox's weights
        replay = self._route_hook(replay=True) if routes is not None and cfg.routing_replay else None
        record = self._route_hook(replay=False) if routes is not None and not cfg.routing_replay else None
        if not cfg.decoupled:
            values["proximal"] = behaviour
        elif cfg.n_minibatches > 1:
            values["proximal"] = [lp.tolist() for lp in self.compute_logprobs(
                sequences, temperature, routes=routes, route_hook=replay or record)]
            record_pending = False
        if cfg.kl_coef > 0:
            values["reference"] = [lp.tolist() for lp in self._reference_logprobs(
                sequences, temperature, routes=routes, route_hook=replay)]
        # else: one optimizer step per batch, so the proximal policy is the very weights of the
        # training forward; its detached logprobs are pi_prox exactly and no extra forward is needed.
        lengths = [len(s) for s in sequences]
        stats: list[dict[str, float]] = []
        trainer_lp: dict[int, torch.Tensor] = {}
        if "proximal" in values and cfg.decoupled:
            trainer_lp = {i: torch.tensor(lp, dtype=torch.float32) for i, lp in enumerate(values["proximal"])}
        for members in kk_partition(lengths, cfg.n_minibatches):
            hook = replay or (record if record_pending else None)
            record_pending = False
            step_stats, gathered = self._minibatch_step(
                [sequences[i] for i in members], {k: [v[i] for i in members] for k, v in values.items()},
                temperature, collect_logprobs=not trainer_lp,
                routes=[routes[i] for i in members] if hook is not None else None, route_hook=hook)
            stats.append(step_stats)
            if gathered is not None:
                trainer_lp = dict(zip(members, gathered))
        out = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
        out["importance_weight_max"] = max(s["importance_weight_max"] for s in stats)
        out.update(tokens=sum(s["tokens"] for s in stats), dropped_tokens=sum(s["dropped_tokens"] for s in stats),
                   truncated_tokens=sum(s["truncated_tokens"] for s in stats),
                   dropped_sequences=sum(s["dropped_sequences"] for s in stats),
                   lr=current_lr(self.optimizer), tokens_per_s=sum(lengths) / (time.perf_counter() - start))
        out.update(self._mismatch(trajectories, trainer_lp, version))
        if record is not None:
            mismatch = record.mismatch(dist.group.WORLD)
            if mismatch is not None:
                out["routing_mismatch"] = mismatch
        return out

    def _rollout_routes(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor] | None:
        """Each trajectory's rollout experts ``[L - 1, layers, top_k]``; None without them (dense
        models, or servers not asked for them) unless ``ppo.routing_replay`` needs them."""
        if not self.arch.is_moe:
            if self.ppo_cfg.routing_replay:
                raise ValueError(f"ppo.routing_replay: {self.arch.model_type} is not a MoE model")
            return None
        missing = [i for i, t in enumerate(trajectories) if t.routed_experts is None]
        if missing:
            if self.ppo_cfg.routing_replay:
                raise ValueError(f"ppo.routing_replay: trajectory {missing[0]} has no routed_experts "
                                 "(set rollout.return_routed_experts: true)")
            return None
        return [decode_routes(t.routed_experts, len(t.input_ids) - 1, self.arch.num_layers,
                              self.arch.num_experts_per_tok, where=f"trajectory {i}")
                for i, t in enumerate(trajectories)]

    def _route_hook(self, replay: bool) -> RouteHook:
        return RouteHook(replay, self.arch.num_experts_per_tok, self.groups.tp_rank, self.groups.tp,
                         self.parallel_cfg.sequence_parallel)

    @staticmethod
    def _mismatch(trajectories: Sequence[Trajectory], trainer_lp: dict[int, torch.Tensor],
                  version: int | None) -> dict[str, float]:
        ids = sorted(trainer_lp)
        if not ids:
            return {}
        fresh = fresh_token_mask([trajectories[i] for i in ids], version)
        cat = lambda rows: torch.cat([torch.as_tensor(r, dtype=torch.float32) for r in rows])  # noqa: E731
        return rollout_mismatch_metrics(cat([trainer_lp[i] for i in ids]),
                                        cat([trajectories[i].behavior_logprobs for i in ids]),
                                        cat([trajectories[i].loss_mask for i in ids]) > 0, cat(fresh) > 0)

    def _minibatch_step(self, sequences: list[list[int]], values: dict[str, Sequence[Sequence[float]]],
                        temperature: float, collect_logprobs: bool = False,
                        routes: Sequence[torch.Tensor] | None = None, route_hook: RouteHook | None = None,
                        ) -> tuple[dict[str, float], list[torch.Tensor] | None]:
        """One optimizer step; with ``collect_logprobs`` also the detached training-forward logprobs
        of every sequence (the weights before this step), on every rank."""
        cfg, groups = self.ppo_cfg, self.groups
        n_loss_tokens = max(sum(sum(m) for m in values["loss_mask"]), 1.0)
        batches = self._plan(sequences, 2 * groups.pp if groups.pp > 1 else 1, values, routes)
        scale = len(batches) * groups.dp  # undo the schedule's 1/M and DDP's 1/D (module docstring)

        def ppo_loss(mb: PackedMicroBatch, lp: torch.Tensor, ent: torch.Tensor):
            v = mb.values
            mask = (v["loss_mask"] > 0) & mb.target_mask
            proximal = v["proximal"] if "proximal" in v else lp.detach()
            seq_ids = None
            if self.objective.per_sequence:
                seq_ids = torch.full_like(mb.targets, -1)
                for k, idx in enumerate(mb.value_index):
                    seq_ids[idx] = k
            loss, st = self.objective(lp, proximal, v["behaviour"], v["advantages"], mask,
                                      loss_scale_tokens=n_loss_tokens, seq_ids=seq_ids)
            kl_sum = 0.0
            if cfg.kl_coef > 0:
                kl = torch.where(mask, kl_penalty(lp, v["reference"]), torch.zeros_like(lp))
                loss = loss + cfg.kl_coef * kl.sum() / n_loss_tokens
                kl_sum = float(kl.sum())
            n = st["tokens"]
            report = {"loss": float(loss.detach()), "tokens": n, "clipped": st["clip_fraction"] * n,
                      "iw_sum": st["importance_weight_mean"] * n, "iw_max": st["importance_weight_max"],
                      "dropped_tokens": st["dropped_tokens"], "entropy_sum": float(ent[mask].sum()),
                      "kl_sum": kl_sum, "truncated_tokens": st["truncated_tokens"],
                      "dropped_sequences": st["dropped_sequences"]}
            if collect_logprobs:
                report["trainer_logprobs"] = lp.detach().float()
            return loss * scale, report

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = run_microbatches(self.model, batches, groups,
                                   vocab_size=self.arch.vocab_size, temperature=temperature, loss_fn=ppo_loss,
                                   forward_only=False, route_hook=route_hook if routes is not None else None)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        reducer = StatsReducer()
        for rep in reports:
            reducer.add(rep)
        out = reducer.reduce(groups.is_last_stage and groups.tp_rank == 0, (groups.mp_group, groups.dp_group),
                             groups.device)
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        out["n_microbatches"] = float(len(batches))
        coef = self.model_cfg.router_aux_loss_coef
        if self.arch.is_moe and (self.arch.router_aux_loss_coef if coef is None else coef) > 0:
            aux = take_aux_loss(groups, sum(1 for mb in batches if mb.n_real_tokens), self.arch.num_layers)
            if aux is not None:
                out["moe_aux_loss"] = aux
        gathered = self._gather(sequences, batches, reports, ("trainer_logprobs",))[0] if collect_logprobs else None
        return out, gathered
