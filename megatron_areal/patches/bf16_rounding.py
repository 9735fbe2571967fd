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

_LOW_HALF = 1 << 16
_HIGH_HALF_MASK = -_LOW_HALF  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 mantissa bits
_CHUNK = 1 << 22  # elements rounded at a time


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator,
                      chunk: int = _CHUNK) -> None:
    """Write fp32 ``src`` into bf16 ``dst``, rounding up with probability equal to the dropped fraction.

    Adding a uniform 16-bit integer to the fp32 bit pattern and truncating the low half carries into
    bf16's last mantissa bit exactly when the noise exceeds the complement of the dropped bits; it
    works for both signs since the sign bit is separate (the magnitude rounds away from zero with
    that probability). Done ``chunk`` elements at a time, in the noise tensor itself, so the only
    temporary is one chunk's 16 MiB (the one-piece form held three copies of the largest parameter,
    340 MB for SmolLM2's embedding, at the optimizer step); the draws are the same either way.
    """
    bits = src.detach().contiguous().view(torch.int32).view(-1)
    out = dst.view(-1)
    for start in range(0, bits.numel(), chunk):
        piece = bits[start:start + chunk]
        noise = torch.randint(0, _LOW_HALF, piece.shape, dtype=torch.int32, generator=generator, device=bits.device)
        noise.add_(piece).bitwise_and_(_HIGH_HALF_MASK)
        out[start:start + chunk].copy_(noise.view(torch.float32))  # exact: the low half is zero


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
