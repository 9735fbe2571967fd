"""Stochastic rounding of the fp32 master weights into the bf16 weights the model computes with.

In Megatron's mixed precision the optimizer updates fp32 master weights and copies them into the
bf16 weights that the forward uses (and that the rollout servers receive), rounding to nearest.
An RL step moves a weight by about ``lr`` (Adam), 1e-5 in the CPU main job, while bf16's spacing
at |w| = 0.05 is 2.4e-4: the bf16 model does not move until the master has drifted half a spacing,
so a short run's learning mostly never reaches the policy that generates and is evaluated.
Measured on SmolLM2-135M: after 8 PPO steps at lr 1e-5, 2.7% of the bf16 weights differed from the
start (98% of the fp32 ones).

Stochastic rounding rounds up with probability equal to the remainder, so each bf16 weight equals
its master in expectation and every step's update reaches the policy, at the price of rounding noise
of up to one spacing per weight (round-to-nearest has half). ``optimizer.bf16_rounding: stochastic``.
"""
from __future__ import annotations

import functools

import torch
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_areal.util.rounding import stochastic_round_


def _distributed_optimizers(optimizer: MegatronOptimizer) -> list[DistributedOptimizer]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    found = [o for o in inner if isinstance(o, DistributedOptimizer)]
    if len(found) != len(inner):
        raise ValueError("optimizer.bf16_rounding=stochastic needs optimizer.distributed=true "
                         "(Megatron's distributed optimizer)")
    return found


def use_stochastic_rounding(optimizer: MegatronOptimizer, seed: int) -> None:
    """Make ``optimizer`` copy its fp32 master shards into the bf16 parameter buffers with stochastic
    rounding (before the DP all-gather, so every rank ends with the same weights)."""
    generator = torch.Generator().manual_seed(seed)
    for opt in _distributed_optimizers(optimizer):
        original = opt._copy_main_params_to_model_params

        @functools.wraps(original)
        def copy(opt: DistributedOptimizer = opt, original=original) -> None:
            original()  # Megatron's own copy (round to nearest), then the bf16 shards are redone
            for main_group, model_group in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
                for main, param in zip(main_group, model_group):
                    world = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    gbuf, _, bucket = opt.model_param_gbuf_map[param]
                    shard = opt.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end]
                    if shard.dtype == torch.bfloat16:
                        stochastic_round_(shard, main, generator)

        opt._copy_main_params_to_model_params = copy
