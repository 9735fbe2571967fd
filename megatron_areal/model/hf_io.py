"""Reading and writing Hugging Face model folders (safetensors), with errors that name the file.

``HFReader`` opens every shard once, checks that each tensor the architecture needs is present
with the shape the config implies, and hands tensors out lazily (one at a time), so a rank only
reads what it holds. ``write_hf_folder`` writes into a temporary sibling folder and renames it
into place, so a failed conversion never leaves a half-written model behind.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch, load_arch

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Everything in an HF folder that is not weights: copied through unchanged.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIP = {INDEX, "pytorch_model.bin.index.json"}


class HFFormatError(ValueError):
    """An HF folder that does not hold the model its config describes."""


def _shard_files(hf_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index or the single ``model.safetensors``."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFFormatError(f"{index}: not a safetensors index ({e})") from None
        files = {name: hf_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise HFFormatError(f"{path}: shard listed in {index} is missing")
        return files
    single = hf_dir / SINGLE
    if not single.is_file():
        found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if len(found) != 1:
            raise HFFormatError(f"{single}: missing (and no {INDEX}); found {found or 'no safetensors files'}")
        single = hf_dir / found[0]
    return {name: single for name in _open(single).keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error type for truncated or corrupt headers
        raise HFFormatError(f"{path}: unreadable safetensors file ({e})") from None


class HFReader:
    """Lazy, validated access to the tensors of an HF model folder."""

    def __init__(self, hf_dir: str | Path, arch: ModelArch | None = None) -> None:
        self.dir = Path(hf_dir)
        self.arch = arch or load_arch(self.dir)
        self._files = _shard_files(self.dir)
        self._handles: dict[Path, object] = {}
        self._validate()

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def _validate(self) -> None:
        needed = set(mapping.hf_tensor_names(self.arch))
        for name, path in self._files.items():
            if name not in needed and not self._ignorable(name):
                raise HFFormatError(f"{path}: tensor {name!r} has no Megatron counterpart for this "
                                    f"{self.arch.model_type} config (dropping it would change the model)")
        for name in mapping.hf_tensor_names(self.arch):
            if name not in self._files:
                raise HFFormatError(f"{self.dir}: tensor {name!r} is missing from the safetensors files")
            path = self._files[name]
            handle = self._handle(path)
            if name not in handle.keys():
                raise HFFormatError(f"{path}: tensor {name!r} listed in the index is not in the file")
            shape = tuple(handle.get_slice(name).get_shape())
            want = mapping.hf_shape(self.arch, name)
            if shape != want:
                raise HFFormatError(f"{path}: tensor {name!r} has shape {shape}, "
                                    f"but {self.dir / 'config.json'} implies {want}")
        self._check_sizes()

    def _ignorable(self, name: str) -> bool:
        # Tied models sometimes store the output layer anyway; old exports store RoPE tables.
        return (name == "lm_head.weight" and self.arch.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")

    def _check_sizes(self) -> None:
        """A truncated file can still have an intact header; compare its size with the header's."""
        for path in sorted(set(self._files.values())):
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if path.stat().st_size < 8 + header_len + end:
                raise HFFormatError(f"{path}: truncated ({path.stat().st_size} bytes, header needs "
                                    f"{8 + header_len + end})")

    def get(self, name: str) -> torch.Tensor:
        try:
            path = self._files[name]
        except KeyError:
            raise HFFormatError(f"{self.dir}: tensor {name!r} is missing from the safetensors files") from None
        return self._handle(path).get_tensor(name)

    def dtype(self) -> torch.dtype:
        return self.get("model.norm.weight").dtype

    def mcore_tensor(self, name: str, padded_vocab: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full Megatron tensor ``name`` (global layer index) built from its HF tensors."""
        parts = [self.get(n) for n in mapping.hf_names(self.arch, name)]
        if dtype is not None:
            parts = [p.to(dtype) for p in parts]
        return mapping.join(self.arch, name, parts, padded_vocab)


def non_weight_files(hf_dir: Path) -> list[Path]:
    """Config, tokenizer and other small files that travel with the weights."""
    return sorted(p for p in hf_dir.iterdir()
                  if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name not in _SKIP)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """A temporary sibling of ``final`` that replaces it on success and vanishes on failure."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and any(final.iterdir()):
        raise FileExistsError(f"{final}: output directory exists and is not empty")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            final.rmdir()
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_hf_weights(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = 4 << 30) -> None:
    """Write (name, tensor) pairs as safetensors, sharded with an index above ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def copy_non_weights(src: Path, dst: Path) -> None:
    for path in non_weight_files(src):
        shutil.copy2(path, dst / path.name)
