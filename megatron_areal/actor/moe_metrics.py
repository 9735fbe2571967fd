"""The router load-balancing loss of the last training pass, for logging.

Megatron's routers add their load-balancing loss to the gradient themselves and record its value
(divided by the coefficient) per layer in megatron-core's MoE logging tracker, once per
micro-batch. ``take_aux_loss`` reads and clears that tracker and reduces it over the ranks: layers
of other pipeline stages are summed in, the sequence-parallel shards of one micro-batch (each TP
rank's share of the sum over its tokens) are summed, and so are data-parallel ranks, whose
micro-batches with sequences are counted for the mean (megatron-core's own reduction uses
``ReduceOp.AVG``, which gloo does not implement).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_areal.actor.parallel import ParallelGroups

TRACKED = "load_balancing_loss"


def take_aux_loss(groups: ParallelGroups, n_microbatches: int, num_layers: int) -> float | None:
    """Mean over layers and micro-batches of the load-balancing loss (without its coefficient), on
    every rank; None when no router recorded one (dense model, or the loss is off). Collective.

    ``n_microbatches``: this rank's micro-batches that have tokens of sequences (one of padding
    only records no loss, actor/engine.py), so a rank may have recorded nothing.
    """
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(TRACKED)
    values = entry["values"].detach().clone().float() if entry is not None else torch.zeros(num_layers)
    values = values.to(groups.device)
    present = torch.tensor([0.0 if entry is None else 1.0], device=groups.device)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)  # every rank must join the reductions below
    if present.item() == 0.0:
        return None
    clear_aux_losses_tracker()
    count = torch.tensor([float(n_microbatches)], device=groups.device)
    for group in (groups.pp_group, groups.tp_group, groups.dp_group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
    if dist.get_world_size(groups.dp_group) > 1:
        dist.all_reduce(count, group=groups.dp_group)
    return float(values.mean()) / max(float(count.item()), 1.0)
