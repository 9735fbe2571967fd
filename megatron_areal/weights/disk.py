"""The disk path: the trainer writes an HF folder, the servers load it with ``/update_weights_from_disk``.

For clusters where the servers cannot join a group with the trainer. Each stage head writes its own
stage's tensors (gathered over TP and the expert ranks, converted with the conversion's mapping)
into one safetensors shard of a shared folder; rank 0 then adds the index and the non-weight files
(config, tokenizer) of the model the servers were started from, and renames the folder into place,
so a server never sees a half-written version.
"""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.hf_io import INDEX, copy_non_weights
from megatron_areal.weights.gather import is_stage_head, stage_hf_tensors

log = logging.getLogger(__name__)


def shard_name(stage: int, stages: int) -> str:
    """The safetensors file name of pipeline stage ``stage`` of ``stages``, as HF names shards."""
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def staging_dir(root: Path, version: str) -> Path:
    """Where a version is written before it is complete."""
    return root / f".v{version}.partial"


def version_dir(root: Path, version: str) -> Path:
    """Where a complete version lies (renamed from its staging folder)."""
    return root / f"v{version}"


@torch.no_grad()
def write_stage(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, out: Path,
                dtype: torch.dtype | None = None) -> tuple[dict[str, str], int]:
    """Every rank calls this; the stage head writes the shard. Returns ({tensor: file}, bytes)."""
    tensors = {name: t.contiguous().cpu() for name, t in stage_hf_tensors(chunks, arch, groups, dtype=dtype)}
    if not is_stage_head(groups):
        return {}, 0
    fname = shard_name(groups.pp_rank, groups.pp)
    save_file(tensors, str(out / fname), metadata={"format": "pt"})
    return dict.fromkeys(tensors, fname), sum(t.numel() * t.element_size() for t in tensors.values())


def write_hf_folder(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *,
                    root: Path, version: str, template_dir: Path, control_group: dist.ProcessGroup | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Collective over ``control_group`` (default: the world): write ``<root>/v<version>``; returns it."""
    rank0 = dist.get_rank(control_group) == 0
    tmp, final = staging_dir(root, version), version_dir(root, version)
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=control_group)
    written = write_stage(chunks, arch, groups, tmp, dtype)
    parts: list[tuple[dict[str, str], int]] = [({}, 0)] * dist.get_world_size(control_group)
    dist.all_gather_object(parts, written, group=control_group)
    if rank0:
        merged = {name: fname for m, _ in parts for name, fname in m.items()}
        total = sum(n for _, n in parts)
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": merged}, indent=2))
        copy_non_weights(Path(template_dir), tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        log.info("wrote weights v%s (%d tensors, %.1f MB) to %s", version, len(merged), total / 1e6, final)
    dist.barrier(group=control_group)
    return final


def prune_versions(root: Path, keep: Path) -> None:
    """Remove older version folders (rank 0 only); servers have loaded ``keep``."""
    for path in root.glob("v*"):
        if path.is_dir() and path != keep:
            shutil.rmtree(path, ignore_errors=True)
