"""Megatron distributed checkpoints of the model, described well enough to be turned back into HF.

A checkpoint directory is a ``megatron.core.dist_checkpointing`` directory (global tensors, so it
loads at any TP/PP layout) with two additions:

- ``megatron_areal.json``: the architecture, the dtype of the original HF weights and the layout
  it was saved at; loading into a different model is refused with an error naming this file;
- ``hf/``: the original config and tokenizer files, copied through on the way back to HF.

Both training checkpoints (``checkpoint/training.py``) and conversion checkpoints
(``convert/convert.py``) are written in this form; ``convert/hf_tensors.py`` reads one back as HF tensors.
"""
from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_areal.model.arch import ModelArch, arch_from_hf_config
from megatron_areal.model.hf_io import non_weight_files

log = logging.getLogger(__name__)

META = "megatron_areal.json"
HF_FILES = "hf"
FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not belong to the model it is loaded into."""


class CheckpointReadError(ValueError):
    """A checkpoint whose tensor files cannot be read (missing, truncated, corrupt)."""


def write_meta(ckpt_dir: Path, arch: ModelArch, hf_dir: Path | None, hf_dtype: torch.dtype,
               tp: int, pp: int, dp: int = 1, ep: int = 1, etp: int = 1, lora: dict[str, Any] | None = None) -> None:
    """Describe the model next to the tensors; copy the HF config and tokenizer files along. ``lora``: the
    ``model.lora`` section of a model with low-rank adapters (their tensors are in the checkpoint too)."""
    meta = {"format_version": FORMAT_VERSION, "arch": arch.to_dict(), "hf_dtype": str(hf_dtype).removeprefix("torch."),
            "saved_tp": tp, "saved_pp": pp, "saved_dp": dp, "saved_ep": ep, "saved_etp": etp}
    if lora is not None:
        meta["lora"] = lora
    (ckpt_dir / META).write_text(json.dumps(meta, indent=2))
    if hf_dir is not None:
        dst = ckpt_dir / HF_FILES
        dst.mkdir(exist_ok=True)
        for path in non_weight_files(Path(hf_dir)):
            shutil.copy2(path, dst / path.name)


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / META
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {ckpt_dir} is not a megatron-areal checkpoint")
    try:
        meta = json.loads(path.read_text())
        meta["arch_obj"] = ModelArch(**{k: tuple(v) if k == "eos_token_ids" else v for k, v in meta["arch"].items()})
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointMismatchError(f"{path}: unreadable checkpoint description ({e})") from None
    return meta


def check_same_model(ckpt_dir: str | Path, arch: ModelArch) -> None:
    """Refuse to load a checkpoint of another model, naming the first differing field."""
    saved = read_meta(ckpt_dir)["arch_obj"]
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "qkv_bias", "qk_norm", "tie_word_embeddings", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size"):
        if getattr(saved, field) != getattr(arch, field):
            raise CheckpointMismatchError(
                f"{Path(ckpt_dir) / META}: checkpoint is of another model ({field}={getattr(saved, field)!r}, "
                f"this model has {getattr(arch, field)!r})")


def hf_arch_from_ckpt(ckpt_dir: Path) -> ModelArch:
    """The architecture, preferring the copied HF config (the source of truth) when present."""
    config = ckpt_dir / HF_FILES / "config.json"
    if config.is_file():
        return arch_from_hf_config(json.loads(config.read_text()), source=str(config))
    return read_meta(ckpt_dir)["arch_obj"]


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    from megatron_areal.model.weights import unwrap

    chunks = [unwrap(c) for c in chunks]
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def load_model_state(chunks: Sequence[torch.nn.Module], state: dict[str, Any]) -> None:
    from megatron_areal.model.weights import unwrap

    chunks = [unwrap(c) for c in chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=True)
        return
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{i}"], strict=True)


def save_model(chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Collective over all ranks: write this rank's shards of the model into ``ckpt_dir``."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks), str(ckpt_dir))


def load_model(chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path, arch: ModelArch) -> None:
    """Collective: fill the chunks from a checkpoint saved at any TP/PP layout."""
    from megatron.core import dist_checkpointing

    check_same_model(ckpt_dir, arch)
    request = model_sharded_state_dict(chunks)
    state = dist_checkpointing.load(request, str(ckpt_dir))
    # a training checkpoint's common state (optimizer, scheduler, the trainer's own) comes back merged in
    load_model_state(chunks, {k: v for k, v in state.items() if k in request})
