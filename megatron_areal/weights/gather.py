"""This stage's parameters as full HF tensors on the stage head, one Megatron parameter at a time.

The same walk as the conversion's ``export_hf_weights`` (its ``named_global_params`` and the
mapping's ``gather`` / ``to_hf``), but every gather ends on the stage head only: the other ranks
just send, so they hold no full tensors and the group moves half the bytes an all-gather would
at TP2 (measured: 0.04 s instead of 0.09 s for 48 MiB per stage on gloo).

Who takes part (``takes_part``): dense parameters come from the head's TP group (data-parallel
replica 0). MoE experts are laid over other ranks: each of the ``ep`` expert-parallel ranks holds
``num_experts / ep`` experts, each split over ``etp`` expert-TP ranks, and these ranks span
data-parallel replicas (Megatron carves EP out of TP x DP). Experts are gathered from the head's
copy of the experts (expert-data-parallel rank 0) in two steps: over expert TP to expert-TP
rank 0, then over EP to the head, which renames each piece to its global expert index.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.weights import ADAPTERS, named_global_params, unwrap
from megatron_areal.weights.wire import adapter_name, merge_update

# the merged pushes' bf16 rounding draws (util/rounding.py), one stream over the run's pushes: a fresh seed per
# push would round each weight against the same thresholds every time
_MERGE_ROUNDING = torch.Generator().manual_seed(0)


def is_stage_head(groups: ParallelGroups) -> bool:
    """The rank that receives its stage's full tensors and sends them to the servers."""
    return groups.tp_rank == 0 and groups.dp_rank == 0


def takes_part(groups: ParallelGroups) -> bool:
    """Whether this rank holds a piece the stage head needs (dense TP shards or experts)."""
    return groups.dp_rank == 0 or groups.edp_rank == 0


def check_head_holds_first_experts(groups: ParallelGroups) -> None:
    """The two-step expert gather ends on expert-TP, EP and expert-DP rank 0: that must be the head."""
    if is_stage_head(groups) and (groups.ep_rank, groups.etp_rank, groups.edp_rank) != (0, 0, 0):
        raise RuntimeError(f"stage head is expert rank ep={groups.ep_rank} etp={groups.etp_rank} "
                           f"edp={groups.edp_rank}, not 0/0/0: the rank order is not Megatron's tp-cp-ep-dp-pp")


def _gather_to_first(local: torch.Tensor, group: dist.ProcessGroup | None,
                     size: int) -> list[torch.Tensor] | None:
    """Every rank's ``local`` in group-rank order on group rank 0, None on the others."""
    if size == 1:
        return [local]
    local = local.contiguous()
    first = dist.get_rank(group) == 0
    pieces = [torch.empty_like(local) for _ in range(size)] if first else None
    dist.gather(local, pieces, group=group, group_dst=0)
    return pieces


def dense_to_head(name: str, local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor | None:
    """The full tensor of a dense parameter on the head, None elsewhere; replicated ones need no traffic."""
    if groups.tp == 1 or mapping.tp_dim(name) is None:
        return local if is_stage_head(groups) else None
    shards = _gather_to_first(local, groups.tp_group, groups.tp)
    return mapping.gather(name, shards) if shards is not None else None


def experts_to_head(name: str, local: torch.Tensor, groups: ParallelGroups,
                    num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """One local expert slot of every EP rank, whole, as (global Megatron name, tensor) on the head."""
    shards = _gather_to_first(local, groups.etp_group, groups.etp)
    if shards is None:
        return []
    full = mapping.gather(name, shards)
    pieces = _gather_to_first(full, groups.ep_group, groups.ep)
    if pieces is None or not is_stage_head(groups):
        return []
    per_rank = num_experts // groups.ep
    slot = mapping.expert_index(name) % per_rank
    return [(mapping.with_expert(name, r * per_rank + slot), t) for r, t in enumerate(pieces)]


@torch.no_grad()
def stage_hf_tensors(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs on the head; every rank that ``takes_part`` must run it to the end
    (the gathers are collective); the others yield nothing."""
    if not takes_part(groups):
        return
    for chunk in chunks:
        # a model.lora run's merged weights (base + B @ A * scale), for SGLang and the disk path; the embedded server
        # and vLLM get the adapters alone (stage_adapter_tensors)
        adapters = getattr(unwrap(chunk), ADAPTERS, None)
        for name, param in named_global_params(chunk):
            if mapping.is_expert(name):
                pairs = experts_to_head(name, param.detach(), groups, arch.num_experts) \
                    if groups.edp_rank == 0 else []
            else:
                full = dense_to_head(name, param.detach(), groups) if groups.dp_rank == 0 else None
                pairs = [] if full is None else [(name, full)]
            # collective over the TP group of data-parallel replica 0, the ranks that gathered the dense tensor
            updates = adapters.hf_updates(name, groups.tp_group) if adapters is not None and groups.dp_rank == 0 \
                else {}
            for hf_name, t in mapping.to_hf(arch, pairs):
                if hf_name in updates:
                    t = merge_update(t, updates[hf_name], _MERGE_ROUNDING)
                yield hf_name, (t if dtype is None else t.to(dtype))


def stage_lora_scale(chunks: Sequence[torch.nn.Module]) -> float | None:
    """``alpha / rank`` of this stage's adapters; None when it has none (a model without ``model.lora``)."""
    for chunk in chunks:
        adapters = getattr(unwrap(chunk), ADAPTERS, None)
        if adapters is not None:
            return float(adapters.scale)
    return None


@torch.no_grad()
def stage_adapter_tensors(chunks: Sequence[torch.nn.Module], groups: ParallelGroups
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's adapters, whole and under PEFT's names (``wire.adapter_name``), on the head: the adapter
    push. The ranks of data-parallel replica 0 gather the TP-split halves (collective: run it to the end);
    the other ranks yield nothing."""
    if groups.dp_rank != 0:
        return
    head = is_stage_head(groups)
    for chunk in chunks:
        adapters = getattr(unwrap(chunk), ADAPTERS, None)
        if adapters is None:
            continue
        for hf_name, a, b in adapters.whole_pairs(groups.tp_group):
            if head:
                yield adapter_name(hf_name, "A"), a
                yield adapter_name(hf_name, "B"), b
