"""Run packed micro-batches through Megatron's pipeline schedule.

``run_microbatches`` feeds a list of ``PackedMicroBatch`` to ``get_forward_backward_func()``
(no pipelining, or 1F1B with PP > 1) and returns what ``loss_fn`` reported per micro-batch. Only
the last pipeline stage calls ``loss_fn``; other stages get an empty list.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _routing_of(chunk: torch.nn.Module, mb: PackedMicroBatch, groups: ParallelGroups) -> Iterator[dict[str, Any]]:
    """Around a MoE chunk's forward: the model's keyword arguments that keep padding out of the
    routers' load-balancing loss.

    A micro-batch ending in padding (sequence parallelism pads to a multiple of TP) gets Megatron's
    ``padding_mask``: the whole mask on the first stage (GPTModel scatters it with the embeddings),
    the sequence-parallel slice on later stages, as their hidden states are. A micro-batch of
    padding only (DP lock step) computes no loss at all (Megatron's loss over zero tokens would be
    0/0): the routers' coefficient is 0 during its forward.
    """
    config = chunk.config
    if not config.num_moe_experts or mb.n_real_tokens == mb.n_tokens:
        yield {}
    elif mb.n_real_tokens == 0:
        coefficient = config.moe_aux_loss_coeff
        config.moe_aux_loss_coeff = 0.0
        try:
            yield {}
        finally:
            config.moe_aux_loss_coeff = coefficient
    else:
        mask = mb.padding_mask()
        if config.sequence_parallel and not getattr(chunk.module, "pre_process", True):
            local = mb.n_tokens // groups.tp
            mask = mask[:, groups.tp_rank * local:(groups.tp_rank + 1) * local]
        yield {"padding_mask": mask}


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
        with _routing_of(chunk, mb, groups) as routing:
            out = chunk(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params(), **routing)
        if route_hook is not None:
            route_hook.after(chunk, mb.routes)
        return out, functools.partial(_on_last_stage, mb, groups, vocab_size, temperature, loss_fn)

    schedule = get_forward_backward_func()
    outputs = schedule(forward_step_func=forward_step, data_iterator=iter(moved), model=model,
                       num_microbatches=len(moved), seq_length=max(mb.n_tokens for mb in moved),
                       micro_batch_size=1, forward_only=forward_only)
    return list(outputs) if groups.is_last_stage else []
