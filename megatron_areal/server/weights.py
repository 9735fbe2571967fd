"""Loading, checking and fingerprinting the server's weights (by Hugging Face tensor name)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn


class WeightError(ValueError):
    """Weights that do not fit the model; the served weights are left unchanged."""


def read_safetensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (single file or sharded with an index)."""
    folder = Path(hf_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{folder}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


def check_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *, complete: bool) -> None:
    """Raise WeightError unless every name is a model tensor of the same shape.

    ``complete`` also requires every model tensor to be present (a load from disk); distributed
    updates may come bucket by bucket, each naming a subset.
    """
    params = dict(model.state_dict())
    tied = getattr(getattr(model, "arch", None), "tie_word_embeddings", False)
    unknown = [n for n in tensors if n not in params and not (tied and n == "lm_head.weight")]
    if unknown:
        raise WeightError(f"unknown tensor names: {', '.join(unknown[:5])}"
                          + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    for name, t in tensors.items():
        if name in params and tuple(t.shape) != tuple(params[name].shape):
            raise WeightError(f"{name}: shape {list(t.shape)} does not match the model's "
                              f"{list(params[name].shape)}")
    if complete:
        missing = [n for n in params if n not in tensors]
        if missing:
            raise WeightError(f"missing tensors: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))


@torch.no_grad()
def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *, complete: bool) -> int:
    """Check everything first, then copy (casting to the model's dtype); returns tensors loaded."""
    check_weights(model, tensors, complete=complete)
    params = dict(model.state_dict())
    loaded = 0
    for name, t in tensors.items():
        if name in params:  # a tied lm_head.weight is the embedding, already loaded
            params[name].copy_(t)
            loaded += 1
    return loaded


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (contiguous, on CPU, in its own dtype)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def checksums(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, dict[str, object]]:
    """Per-tensor fingerprints, optionally after casting to ``dtype`` (to compare a bf16 folder)."""
    out: dict[str, dict[str, object]] = {}
    for name, t in model.state_dict().items():
        t = t if dtype is None else t.to(dtype)
        out[name] = {"sha256": tensor_checksum(t), "dtype": str(t.dtype).removeprefix("torch."),
                     "shape": list(t.shape)}
    return out


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightError(f"unknown dtype {name!r}")
    return dtype
