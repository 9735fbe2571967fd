"""The low-rank adapters of a checkpoint: as a PEFT folder, or merged into the HF weights.

A checkpoint of a ``model.lora`` run holds the base weights (frozen) and, per targeted projection and global
layer, the whole ``A [rank, in]`` and ``B [out, rank]`` (``lora_sites.checkpoint_key``); its
``megatron_areal.json`` holds the ``model.lora`` section. ``write_peft`` writes what PEFT's
``save_pretrained`` writes for a ``LoraConfig`` on the HF model (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's tensor names), so ``PeftModel.from_pretrained(base, folder)`` loads
it; ``merged`` adds ``B @ A * alpha / rank`` to each adapted HF weight, as PEFT's ``merge_and_unload`` does.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_areal.checkpoint.dist_ckpt import CheckpointMismatchError
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.lora_sites import checkpoint_key, hf_weight_name, peft_name, site_of

Adapters = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A, B), whole


def read_adapters(ckpt_dir: Path, arch: ModelArch, settings: dict[str, Any]) -> Adapters:
    """Every adapter of the checkpoint, whole (inside ``local_process_group()``)."""
    from megatron.core import dist_checkpointing

    from megatron_areal.convert.hf_tensors import _load_full

    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    wanted = [(layer, t) for layer in range(arch.num_layers) for t in settings["targets"]]
    keys = [checkpoint_key(layer, t, m) for layer, t in wanted for m in ("A", "B")]
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise CheckpointMismatchError(f"{ckpt_dir}: checkpoint lacks adapter tensor {missing[0]}")
    loaded = _load_full(ckpt_dir, metadata, keys)
    return {(layer, t): (loaded[checkpoint_key(layer, t, "A")], loaded[checkpoint_key(layer, t, "B")])
            for layer, t in wanted}


def _hf_module(arch: ModelArch, target: str) -> str:
    site = site_of(arch, target)
    return site.hf_modules[site.targets.index(target)]


def merged(arch: ModelArch, tensors: Iterator[tuple[str, torch.Tensor]], adapters: Adapters,
           settings: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with each adapted projection's update added (in fp32, then back to the tensor's dtype)."""
    scale = settings["alpha"] / settings["rank"]
    updates = {hf_weight_name(layer, _hf_module(arch, t)): (a, b) for (layer, t), (a, b) in adapters.items()}
    for name, tensor in tensors:
        if name in updates:
            a, b = updates[name]
            tensor = (tensor.float() + b.float() @ a.float() * scale).to(tensor.dtype)
        yield name, tensor


def adapter_config(settings: dict[str, Any], base: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of a ``model.lora`` section (a plain LoRA: no bias, no rsLoRA, no DoRA)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": settings["rank"], "lora_alpha": settings["alpha"], "lora_dropout": settings["dropout"],
            "target_modules": sorted(settings["targets"]), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "inference_mode": True}


def write_peft(out_dir: Path, arch: ModelArch, adapters: Adapters, settings: dict[str, Any],
               dtype: torch.dtype, base: str | None = None) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (which exists)."""
    from safetensors.torch import save_file

    tensors = {}
    for (layer, target), (a, b) in adapters.items():
        module = _hf_module(arch, target)
        tensors[peft_name(layer, module, "A")] = a.to(dtype).contiguous()
        tensors[peft_name(layer, module, "B")] = b.to(dtype).contiguous()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(settings, base), indent=2))
