"""Run packed micro-batches through Megatron's pipeline schedule.

``run_microbatches`` feeds a list of ``PackedMicroBatch`` to ``get_forward_backward_func()``
(no pipelining, or 1F1B with PP > 1) and returns what ``loss_fn`` reported per micro-batch. Only
the last pipeline stage calls ``loss_fn``; other stages get an empty list.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_areal.actor.logprobs import vocab_parallel_logprobs
from megatron_areal.actor.microbatch import PackedMicroBatch
from megatron_areal.actor.parallel import ParallelGroups

# loss_fn(micro_batch, logprobs [T], entropy [T]) -> (scalar loss for backward, report dict)
LossFn = Callable[[PackedMicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def _on_last_stage(mb: PackedMicroBatch, groups: ParallelGroups, vocab_size: int, temperature: float,
                   loss_fn: LossFn, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    logprobs, entropy = vocab_parallel_logprobs(
        logits[0], mb.targets, tp_group=groups.tp_group, tp_rank=groups.tp_rank, vocab_size=vocab_size,
        temperature=temperature)
    return loss_fn(mb, logprobs, entropy)


def _router_padding(chunk: torch.nn.Module, mb: PackedMicroBatch, groups: ParallelGroups) -> dict[str, Any]:
    """``padding_mask`` for a MoE chunk whose micro-batch ends in padding (sequence parallelism pads
    to a multiple of TP), so the routers' load-balancing loss counts only the sequences' tokens.

    The first stage gets the whole mask (GPTModel scatters it with the embeddings); later stages
    get their sequence-parallel slice, as their hidden states are. A micro-batch of padding only
    (DP lock step) keeps no mask: Megatron's loss over zero tokens would be 0/0.
    """
    config = chunk.config
    if not config.num_moe_experts or mb.n_real_tokens in (0, mb.n_tokens):
        return {}
    mask = mb.padding_mask()
    if config.sequence_parallel and not getattr(chunk.module, "pre_process", True):
        local = mb.n_tokens // groups.tp
        mask = mask[:, groups.tp_rank * local:(groups.tp_rank + 1) * local]
    return {"padding_mask": mask}


def run_microbatches(model: list[torch.nn.Module], batches: list[PackedMicroBatch], groups: ParallelGroups, *,
                     vocab_size: int, temperature: float, loss_fn: LossFn,
                     forward_only: bool, route_hook: Any = None) -> list[dict[str, Any]]:
    """One pass over ``batches`` (forward, plus backward unless ``forward_only``).

    ``route_hook`` (MoE, actor/routing_replay.py ``RouteHook``) replays or records each micro-batch's
    expert routes around its forward.
    """
    if not batches:
        return []
    device = groups.device
    moved = [mb.to(device) for mb in batches]

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        if route_hook is not None:
            route_hook.before(chunk, mb.routes)
        out = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(),
                    **_router_padding(chunk, mb, groups))
        if route_hook is not None:
            route_hook.after(chunk, mb.routes)
        return out, functools.partial(_on_last_stage, mb, groups, vocab_size, temperature, loss_fn)

    schedule = get_forward_backward_func()
    outputs = schedule(forward_step_func=forward_step, data_iterator=iter(moved), model=model,
                       num_microbatches=len(moved), seq_length=max(mb.n_tokens for mb in moved),
                       micro_batch_size=1, forward_only=forward_only)
    return list(outputs) if groups.is_last_stage else []
