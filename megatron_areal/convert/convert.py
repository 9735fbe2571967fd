"""HF folder <-> Megatron distributed checkpoint, the two directions of ``megatron-areal convert``.

``hf_to_mcore`` validates the HF folder in the calling process (so bad input fails fast with a
clear message), then runs ``tp * pp`` ranks (for MoE models ``pp * lcm(tp, ep * etp)``: expert
parallelism lives inside the TP x DP ranks) that each build their pipeline stage, fill it with
their TP (and EP / expert-TP) slice of the HF weights and write their shards. ``mcore_to_hf`` needs no model and no
process group: it reads global tensors from the checkpoint one layer at a time. Both write into a
temporary sibling directory that is renamed into place only when everything succeeded.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from megatron_areal.checkpoint import dist_ckpt
from megatron_areal.convert.hf_tensors import local_process_group, read_hf_tensors
from megatron_areal.convert.spawn import WorkerPool
from megatron_areal.model import mapping
from megatron_areal.model.arch import load_arch
from megatron_areal.model.hf_io import HFReader, atomic_dir, copy_non_weights, write_hf_weights

log = logging.getLogger(__name__)


class LayoutError(ValueError):
    """A TP/PP/EP layout the model cannot be split into."""


def save_hf_as_mcore_rank(hf_dir: str, out_dir: str, tp: int, pp: int, dtype: str = "float32", ep: int = 1,
                          etp: int = 1) -> float:
    """One rank of ``hf_to_mcore`` (runs inside a worker of the pool); returns its seconds."""
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.weights import load_hf_weights

    start = time.time()
    arch = load_arch(hf_dir)
    groups = init_parallel(tp=tp, pp=pp, backend="gloo", ep=ep, etp=etp)
    try:
        chunks = build_model(arch, groups, dtype=getattr(torch, dtype))
        load_hf_weights(chunks, hf_dir, arch, groups.tp_rank, groups.tp, etp_rank=groups.etp_rank, etp_size=etp)
        dist_ckpt.save_model(chunks, out_dir)
    finally:
        teardown_parallel()
    return time.time() - start


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1,
                pool: WorkerPool | None = None, ep: int = 1, etp: int = 1) -> Path:
    """Convert an HF folder into a Megatron distributed checkpoint saved at layout (tp, pp, ep, etp)."""
    from megatron_areal.actor.model import check_layout
    from megatron_areal.actor.parallel import check_world, min_world

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    arch = load_arch(hf_dir)
    try:
        check_layout(arch, tp, pp, ep, etp)
    except ValueError as e:
        raise LayoutError(f"{hf_dir / 'config.json'}: {e}") from None
    hf_dtype = HFReader(hf_dir, arch).dtype()  # validates every tensor's presence and shape
    own_pool = pool is None
    pool = pool or WorkerPool(min_world(tp, pp, ep, etp))
    check_world(pool.world, tp, pp, ep, etp)  # a larger pool writes from data-parallel replicas too
    world = pool.world
    try:
        with atomic_dir(out_dir) as tmp:
            pool.run(save_hf_as_mcore_rank, str(hf_dir), str(tmp), tp, pp, ep=ep, etp=etp)
            dist_ckpt.write_meta(tmp, arch, hf_dir, hf_dtype, tp, pp, dp=world // (tp * pp), ep=ep, etp=etp)
    finally:
        if own_pool:
            pool.close()
    log.info("wrote Megatron checkpoint %s (tp=%d pp=%d ep=%d etp=%d) from %s", out_dir, tp, pp, ep, etp, hf_dir)
    return out_dir


def mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                adapter_only: bool = False) -> Path:
    """Convert a Megatron checkpoint (conversion or training) back into an HF folder.

    A checkpoint with low-rank adapters (``model.lora``) is written merged (base + ``B @ A * alpha / rank``),
    or with ``adapter_only`` as a PEFT adapter folder (``convert/peft_export.py``)."""
    from megatron_areal.convert import peft_export

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = dist_ckpt.read_meta(ckpt_dir)
    arch = dist_ckpt.hf_arch_from_ckpt(ckpt_dir)
    dist_ckpt.check_same_model(ckpt_dir, arch)
    dtype = dtype or getattr(torch, meta["hf_dtype"])
    lora = meta.get("lora")
    if adapter_only and not lora:
        raise dist_ckpt.CheckpointMismatchError(f"{ckpt_dir / dist_ckpt.META}: --adapter-only, but the checkpoint "
                                                "has no low-rank adapters (model.lora.rank was 0)")
    with atomic_dir(out_dir) as tmp, local_process_group():
        adapters = peft_export.read_adapters(ckpt_dir, arch, lora) if lora else {}
        if adapter_only:
            peft_export.write_peft(tmp, arch, adapters, lora, dtype)
        else:
            tensors = ((n, t.to(dtype)) for n, t in read_hf_tensors(ckpt_dir, arch))
            if lora:
                tensors = peft_export.merged(arch, tensors, adapters, lora)
            write_hf_weights(tmp, _checked(arch, tensors))
            if (ckpt_dir / dist_ckpt.HF_FILES).is_dir():
                copy_non_weights(ckpt_dir / dist_ckpt.HF_FILES, tmp)
    log.info("wrote %s %s from %s", "PEFT adapter folder" if adapter_only else "HF folder", out_dir, ckpt_dir)
    return out_dir


def _checked(arch, tensors):
    """Pass tensors through, refusing any whose shape does not match the config."""
    for name, t in tensors:
        want = mapping.hf_shape(arch, name)
        if tuple(t.shape) != want:
            raise dist_ckpt.CheckpointMismatchError(f"{name}: checkpoint holds shape {tuple(t.shape)}, "
                                                    f"the config implies {want}")
        yield name, t
