"""Megatron DDP, the (distributed) optimizer and the learning-rate schedule for the actor.

Megatron's ``DistributedDataParallel`` is required, not a convenience: with PP > 1 it (through
``finalize_model_grads``) keeps tied embedding/output weights and sequence-parallel norm weights
in sync; a plain torch optimizer drifts. Gradients are averaged over DP ranks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_areal.actor.config import OptimizerConfig
from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.actor.precision_adam import PrecisionAwareAdam
from megatron_areal.patches.bf16_rounding import use_stochastic_rounding
from megatron_areal.patches.precision_aware_without_te import inner_adam


@dataclass
class TrainState:
    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler


def wrap_ddp(chunks: list[GPTModel], opt: OptimizerConfig) -> list[DistributedDataParallel]:
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=opt.main_grads_dtype == "float32",
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=opt.distributed,
                                               check_for_nan_in_grad=False)
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c,
                                       disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for c in chunks:
        # the pipeline schedule calls this after the last backward: DP all-reduce, tied weights, SP norms
        c.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_train_state(chunks: list[GPTModel], opt: OptimizerConfig, groups: ParallelGroups,
                      total_steps: int) -> TrainState:
    """Wrap ``chunks`` in DDP and build the optimizer and scheduler; ``total_steps`` optimizer steps."""
    model = wrap_ddp(chunks, opt)
    dtype = chunks[0].config.params_dtype
    mcfg = McoreOptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=opt.distributed)
    stochastic = opt.bf16_rounding == "stochastic" and dtype == torch.bfloat16
    use_gloo = groups.backend != "gloo"
    if opt.precision_aware:
        optimizer = _precision_aware_optimizer(mcfg, model, opt, use_gloo, "stochastic" if stochastic else "nearest")
    else:
        optimizer = get_megatron_optimizer(mcfg, model, use_gloo_process_groups=use_gloo)
        if stochastic:
            use_stochastic_rounding(optimizer, seed=torch.initial_seed())
    steps = max(total_steps, 1)
    warmup = min(opt.warmup_steps, steps - 1) if steps > 1 else 0
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=steps, lr_decay_style=opt.lr_schedule,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=steps, wd_incr_style="constant")
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler)


def _precision_aware_optimizer(mcfg: McoreOptimizerConfig, model: list[DistributedDataParallel],
                               opt: OptimizerConfig, use_gloo: bool, rounding: str) -> MegatronOptimizer:
    """Megatron's distributed optimizer in its precision-aware mode, with ``PrecisionAwareAdam`` inside: no fp32
    master copies, gradients read from the DDP buffer in its dtype, moments in theirs.

    megatron-core enables the mode only where Transformer Engine's FusedAdam imports (its config checks
    at construction), so the flags are set on the built config, and the inner Adam class is given where
    ``get_megatron_optimizer`` looks for TE's."""
    mcfg.use_precision_aware_optimizer = mcfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    mcfg.store_param_remainders = True
    mcfg.main_grads_dtype, mcfg.exp_avg_dtype, mcfg.exp_avg_sq_dtype = (
        getattr(torch, name) for name in (opt.main_grads_dtype, opt.exp_avg_dtype, opt.exp_avg_sq_dtype))
    adam = functools.partial(PrecisionAwareAdam, rounding=rounding, seed=torch.initial_seed())
    with inner_adam(adam):
        return get_megatron_optimizer(mcfg, model, use_gloo_process_groups=use_gloo)


def current_lr(optimizer: MegatronOptimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
