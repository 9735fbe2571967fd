"""A Megatron distributed checkpoint read back as HF tensors, without a model or a process group.

Megatron stores transformer layers stacked along a leading layer axis under one key
(``decoder.layers.self_attention.linear_qkv.weight`` has shape ``[num_layers, ...]``) and uses the
Transformer-Engine names for the fused norms; ``read_hf_tensors`` undoes both, one layer at a
time. MoE experts are stacked along a second axis
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` has shape ``[num_layers, num_experts, ...]``),
so a checkpoint saved at one expert-parallel layout loads at any other.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_areal.checkpoint.dist_ckpt import CheckpointMismatchError, CheckpointReadError
from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch

_STACKED = "decoder.layers."


def _load_full(ckpt_dir: Path, metadata: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole global tensors by checkpoint key (a one-rank world cannot load partial regions)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint.api import CheckpointException

    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(metadata[k].global_shape),
                                                                 dtype=metadata[k].dtype), replica_id=0)
               for k in keys}
    try:
        return dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)
    except (CheckpointException, OSError, RuntimeError, EOFError) as e:  # torch's error derives from BaseException
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise CheckpointReadError(f"{ckpt_dir}: cannot read the checkpoint's tensors "
                                  f"({lines[-1] if lines else type(e).__name__})") from None


def _checkpoint_key(name: str) -> tuple[str, tuple[int, ...]]:
    """Checkpoint key of a global Megatron name and its index on the stacked (layer[, expert]) axes."""
    if not name.startswith(_STACKED):
        return name, ()
    layer, rest = mapping.te_name(name)[len(_STACKED):].split(".", 1)
    expert = mapping.expert_index(name)
    if expert is None:
        return _STACKED + rest, (int(layer),)
    param = rest.split(".", 4)[-1]  # mlp.experts.local_experts.{e}.<param>
    return f"{_STACKED}mlp.experts.experts.{param}", (int(layer), expert)


@contextmanager
def local_process_group() -> Iterator[None]:
    """A one-rank gloo world for dist_checkpointing calls made outside a distributed job."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def read_hf_tensors(ckpt_dir: str | Path, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of a checkpoint, in HF order, one layer's tensors in memory at a time.

    Outside a distributed job, run it inside ``local_process_group()``.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    names = mapping.mcore_names(arch)
    keys = sorted({_checkpoint_key(n)[0] for n in names})
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise CheckpointMismatchError(f"{ckpt_dir}: checkpoint lacks {missing[0]} (is it a {arch.model_type} model?)")
    for key in keys:
        if key.startswith(_STACKED) and metadata[key].global_shape[0] != arch.num_layers:
            raise CheckpointMismatchError(f"{ckpt_dir}: {key} holds {metadata[key].global_shape[0]} layers, "
                                          f"the model has {arch.num_layers}")
    loaded = _load_full(ckpt_dir, metadata, keys)
    for name in names:
        key, index = _checkpoint_key(name)
        yield from mapping.split(arch, name, loaded[key][index] if index else loaded[key])
