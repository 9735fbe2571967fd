"""A ``model.lora`` run's adapter push inside a vLLM worker: only ``A`` and ``B`` arrive, merged here.

The worker keeps, per adapted HF weight, the base weight read from the model folder the server started
from (the trainer's base is frozen, so it is the same) and hands vLLM's own ``load_weights`` the merged
weight ``W_base + lora_scale * B @ A`` (``weights/wire.AdapterMerge``), so vLLM's loader lays it out
(fused ``qkv_proj`` / ``gate_up_proj``, TP split) as it does a full push.

Why not vLLM's own LoRA loading (``--enable-lora``, ``/v1/load_lora_adapter``; the CPU build has a punica
wrapper): it takes adapters from a folder on a filesystem the trainer shares, ``--enable-lora`` turns off the
CPU build's compilation (``platforms/cpu.py`` sets ``CompilationMode.NONE`` when a LoRA config is given),
and requests would have to name a new adapter after every push for the weight version to change; merging
keeps the weight-transfer group, pause and resume, and per-token versions exactly as for full pushes.

A fused vLLM layer reloaded in part would lose its other parts (vLLM's layerwise reload rebuilds the whole
layer from what is loaded), so an adapted projection travels with the kept bases of the projections fused
with it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_areal.weights.wire import AdapterMerge, adapter_target

# HF projections vLLM fuses into one layer (Llama- and Qwen-style models): loaded together
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FolderWeights:
    """Single tensors of a safetensors model folder, read on demand (the base of the adapted weights)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = {n: self.folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.files = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self.files.update({n: path for n in f.keys()})  # noqa: SIM118 - safe_open has no iterator

    def shape(self, name: str) -> list[int] | None:
        if name not in self.files:
            return None
        with safe_open(str(self.files[name]), framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"{self.folder}: no weight {name!r} for an adapter to merge into")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


def fused_siblings(hf_name: str) -> list[str]:
    """The other HF weights vLLM fuses with ``hf_name`` into one layer (empty when none)."""
    module, _, leaf = hf_name.removesuffix(".weight").rpartition(".")
    for group in FUSED:
        if leaf in group:
            return [f"{module}.{other}.weight" for other in group if other != leaf]
    return []


class VLLMAdapterMerge:
    """Turns a bucket of adapter tensors into the whole HF weights vLLM's ``load_weights`` takes."""

    def __init__(self, folder: str | Path, dtype: torch.dtype) -> None:
        self.folder_weights = FolderWeights(folder)
        self.dtype = dtype  # the served weights' dtype: the kept base is held in it, as the server holds it
        self.merge = AdapterMerge(lambda name: self.folder_weights(name).to(dtype))
        self.siblings: dict[str, torch.Tensor] = {}

    def weights(self, tensors: dict[str, torch.Tensor], scale: float | None) -> list[tuple[str, torch.Tensor]]:
        merged = self.merge.merged(tensors, scale, self.folder_weights.shape)
        adapted = {adapter_target(n)[0] for n in tensors if adapter_target(n) is not None}
        for name in sorted(adapted):
            for other in (name, *fused_siblings(name)):  # the target itself when only one half came so far
                if other not in merged:
                    merged[other] = self._sibling(other)
        return list(merged.items())

    def _sibling(self, name: str) -> torch.Tensor:
        """The value a weight is served with: merged when it has both adapter halves, else its base."""
        value = self.merge.value(name)
        if value is not None:
            return value
        if name not in self.siblings:
            self.siblings[name] = self.folder_weights(name).to(self.dtype)
        return self.siblings[name]
