"""Where low-rank adapters sit in a Megatron model, and what PEFT calls them.

An adapter targets one HF projection (``q_proj`` ... ``down_proj``). Megatron fuses some of them: q, k and v
live in one column-parallel ``linear_qkv``, gate and up in one ``linear_fc1``; o and down are the row-parallel
``linear_proj`` and ``linear_fc2``. A ``Site`` is one such Megatron linear layer with the projections fused
into it, read from ``mapping`` (the HF <-> Megatron name rules), so no name table is repeated here.

Each targeted projection keeps its own pair ``A [rank, in]``, ``B [out, rank]`` (the HF projection's shapes),
so the adapters are PEFT's exactly; the fused layer's update is the per-projection updates laid out the way
its weight fuses them (``mapping.join``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch

# Megatron's linear layers (names inside a transformer layer) that adapters may sit beside
LINEAR_LAYERS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
PEFT_PREFIX = "base_model.model."  # PeftModel's name for the HF model's own parameter names


@dataclass(frozen=True)
class Site:
    megatron: str  # linear layer inside a transformer layer, e.g. "self_attention.linear_qkv"
    hf_modules: tuple[str, ...]  # HF modules fused into it, in the fused order, e.g. ("self_attn.q_proj", ...)
    kind: str  # how they are fused: mapping's "qkv", "glu" or "copy"
    column: bool  # column-parallel (output split over TP) or row-parallel (input split)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(m.rsplit(".", 1)[-1] for m in self.hf_modules)

    def weight_name(self, layer: int) -> str:
        return f"decoder.layers.{layer}.{self.megatron}.weight"


def sites(arch: ModelArch) -> list[Site]:
    """The adaptable linear layers of ``arch``; MoE models have no dense MLP, only attention sites."""
    out = []
    for linear in LINEAR_LAYERS:
        if arch.is_moe and linear.startswith("mlp."):
            continue
        name = f"decoder.layers.0.{linear}.weight"
        hf = tuple(n.removeprefix("model.layers.0.").removesuffix(".weight") for n in mapping.hf_names(arch, name))
        out.append(Site(linear, hf, mapping.rule_kind(name), mapping.tp_dim(name) == 0))
    return out


def check_targets(arch: ModelArch, targets: list[str]) -> None:
    """Refuse projections the model has no adapter site for (a MoE model's experts), naming the key."""
    known = {t for s in sites(arch) for t in s.targets}
    missing = [t for t in targets if t not in known]
    if missing:
        why = (f"{arch.model_type} is a mixture-of-experts model and adapters on its experts are not supported; "
               "target the attention projections (q_proj, k_proj, v_proj, o_proj)") if arch.is_moe else \
            f"{arch.model_type} has no {missing[0]}"
        raise ValueError(f"model.lora.targets: {missing[0]!r}: {why}")


def hf_shape(arch: ModelArch, hf_module: str) -> tuple[int, int]:
    """(out_features, in_features) of an HF projection."""
    out_features, in_features = mapping.hf_shape(arch, f"model.layers.0.{hf_module}.weight")
    return out_features, in_features


def peft_name(layer: int, hf_module: str, matrix: str) -> str:
    """PEFT's saved name of adapter ``matrix`` ("A" or "B") of one projection."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{hf_module}.lora_{matrix}.weight"


def hf_weight_name(layer: int, hf_module: str) -> str:
    return f"model.layers.{layer}.{hf_module}.weight"


def checkpoint_key(layer: int, target: str, matrix: str) -> str:
    """The adapter tensor's key in a Megatron distributed checkpoint (global layer index)."""
    return f"lora.layers.{layer}.{target}.{matrix}"


def site_of(arch: ModelArch, target: str) -> Site:
    for s in sites(arch):
        if target in s.targets:
            return s
    raise ValueError(f"model.lora.targets: no adapter site for {target!r}")
