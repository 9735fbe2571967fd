"""Move weights between Hugging Face tensors and a live Megatron model at any TP/PP layout.

``load_hf_weights`` fills this rank's pipeline-stage chunks from an HF folder, reading only the
tensors it needs and keeping only its TP slice. ``export_hf_weights`` is the inverse for one
stage: it gathers each parameter across the TP group and yields HF (name, tensor) pairs one
parameter at a time, so the weight transfer to rollout servers never holds more than one layer's
worth of full tensors.

MoE models: each expert-parallel rank holds ``num_experts / ep`` experts, each split over the
``etp`` expert-TP ranks. Loading slices expert tensors by expert-TP rank; exporting gathers them
over expert TP and then over EP, so every rank of an EP group yields every expert.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.hf_io import HFReader

log = logging.getLogger(__name__)


def layer_offset(chunk: torch.nn.Module) -> int:
    """Global index of this chunk's first transformer layer (0 on a stage without layers)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if not layers:
        return 0
    return int(layers[0].layer_number) - 1


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def expert_offset(chunk: torch.nn.Module) -> int:
    """Global index of this rank's first expert (0 for dense models and at EP1)."""
    for module in chunk.modules():
        indices = getattr(module, "local_expert_indices", None)
        if indices:
            return int(indices[0])
    return 0


ADAPTERS = "lora"  # a chunk's low-rank adapters (actor/lora.py): beside the model's weights, not among them


def named_global_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global Megatron name, parameter) of a (possibly wrapped) chunk; layer and expert indices are
    whole-model. Low-rank adapters are not model weights and are left out."""
    chunk = unwrap(chunk)
    offset, experts = layer_offset(chunk), expert_offset(chunk)
    for name, param in chunk.named_parameters():
        if name.startswith(ADAPTERS + "."):
            continue
        yield mapping.canonical(mapping.global_name(name, offset, experts)), param


def _source_name(arch: ModelArch, name: str) -> str:
    # With tied embeddings the last stage still has its own copy of the output layer when PP > 1.
    if arch.tie_word_embeddings and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


@torch.no_grad()
def load_hf_weights(chunks: Sequence[torch.nn.Module], hf: str | Path | HFReader, arch: ModelArch,
                    tp_rank: int, tp_size: int, optimizer: Any = None, *, etp_rank: int = 0, etp_size: int = 1) -> int:
    """Copy HF weights into this rank's chunks; returns the number of parameters filled.

    Chunks may be wrapped in Megatron DDP. Pass the optimizer when it already exists, so its
    fp32 main copies (bf16 training) pick up the new weights. ``etp_rank``/``etp_size``: this
    rank's place among the expert-TP ranks (MoE models).
    """
    reader = hf if isinstance(hf, HFReader) else HFReader(hf, arch)
    filled = 0
    for chunk in chunks:
        for name, param in named_global_params(chunk):
            rank, size = (etp_rank, etp_size) if mapping.is_expert(name) else (tp_rank, tp_size)
            padded = param.shape[0] * size if mapping.tp_dim(name) == 0 else param.shape[0]
            full = reader.mcore_tensor(_source_name(arch, name), padded_vocab=padded, dtype=param.dtype)
            local = mapping.shard(name, full, rank, size)
            if local.shape != param.shape:
                raise ValueError(f"{reader.dir}: {name} maps to shape {tuple(local.shape)} on tp rank {rank}, "
                                 f"but the model expects {tuple(param.shape)}")
            param.copy_(local)
            filled += 1
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # mixed precision keeps fp32 main copies of the weights
    log.info("loaded %d parameters from %s (tp rank %d/%d)", filled, reader.dir, tp_rank, tp_size)
    return filled


def gather_tp(name: str, local: torch.Tensor, tp_group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    """The full tensor of a TP-split parameter (every rank of the group gets it)."""
    if tp_size == 1 or mapping.tp_dim(name) is None:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    return mapping.gather(name, shards)


def gather_experts(name: str, local: torch.Tensor, ep_group: dist.ProcessGroup | None, ep_size: int,
                   local_experts: int) -> list[tuple[str, torch.Tensor]]:
    """The same local expert slot of every EP rank, each named by its global expert index.

    EP rank ``r`` holds experts ``[r * local_experts, (r + 1) * local_experts)``.
    """
    if ep_size == 1:
        return [(name, local)]
    pieces = [torch.empty_like(local) for _ in range(ep_size)]
    dist.all_gather(pieces, local.contiguous(), group=ep_group)
    slot = mapping.expert_index(name) % local_experts
    return [(mapping.with_expert(name, r * local_experts + slot), t) for r, t in enumerate(pieces)]


@torch.no_grad()
def export_hf_weights(chunks: Sequence[torch.nn.Module], arch: ModelArch, tp_group: dist.ProcessGroup | None,
                      tp_size: int, dtype: torch.dtype | None = None, *, etp_group: dist.ProcessGroup | None = None,
                      etp_size: int = 1, ep_group: dist.ProcessGroup | None = None,
                      ep_size: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of this stage's parameters, TP-gathered, one parameter at a time.

    Every rank of the TP group must iterate in step (the gathers are collective). With tied
    embeddings only the stage that holds ``embedding`` yields ``model.embed_tokens.weight``.
    MoE: expert tensors are gathered over expert TP and EP (pass those groups), so every rank
    yields all experts. A chunk with low-rank adapters yields its merged weights (base + ``B @ A * scale``).
    """
    for chunk in chunks:
        adapters = getattr(unwrap(chunk), ADAPTERS, None)
        for name, param in named_global_params(chunk):
            if mapping.is_expert(name):
                full = gather_tp(name, param.detach(), etp_group, etp_size)
                pairs = gather_experts(name, full, ep_group, ep_size, arch.num_experts // ep_size)
            else:
                pairs = [(name, gather_tp(name, param.detach(), tp_group, tp_size))]
            updates = adapters.hf_updates(name, tp_group) if adapters is not None else {}
            for hf_name, t in mapping.to_hf(arch, pairs):
                if hf_name in updates:
                    t = (t.float() + updates[hf_name]).to(t.dtype)
                yield hf_name, (t if dtype is None else t.to(dtype))
