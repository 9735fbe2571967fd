"""The one mapping between Hugging Face and Megatron-core GPTModel parameters (Llama/Qwen2/Qwen3,
Qwen2-MoE, Qwen3-MoE, Mixtral).

Every tensor of a Megatron model is described by one ``Rule``: which HF tensors it is made of, how
they are joined (fused QKV interleaved per query group, fused gate/up, padded vocabulary) and how
it is split across tensor-parallel ranks. Conversion, HF loading into a live model, checkpoint
export and the weight transfer to rollout servers all go through the functions below.

Names here are *global*: ``decoder.layers.{i}`` uses the layer's index in the whole model, not its
index inside a pipeline stage (see ``global_name``). Both the local-spec names
(``input_layernorm.weight``) and the Transformer-Engine names (``linear_qkv.layer_norm_weight``)
are accepted; ``canonical`` turns the latter into the former.

Mixture-of-Experts layers hold ``mlp.router.weight`` (HF ``mlp.gate.weight``; Mixtral
``block_sparse_moe.gate.weight``) and, per expert, ``mlp.experts.local_experts.{e}.linear_fc1/linear_fc2
.weight`` (Megatron's SequentialMLP; HF ``gate_proj``/``up_proj``/``down_proj``, Mixtral ``w1``/``w3``/``w2``,
named by ``ModelArch.hf_moe_block`` and ``hf_expert_projections``). Qwen2-MoE's shared expert is
``mlp.shared_experts.linear_fc1/linear_fc2.weight`` and ``mlp.shared_experts.gate_weight`` (HF
``mlp.shared_expert.{gate,up,down}_proj.weight``, ``mlp.shared_expert_gate.weight``), split over the
attention's TP ranks like a dense MLP.
Global names number experts over the whole model too: ``{e}`` is the expert's index among all
``num_experts`` (``global_name`` adds the expert-parallel rank's offset), and expert tensors are
split over the expert-tensor-parallel ranks (``etp``), not the attention's TP ranks.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_areal.model.arch import ModelArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

# Transformer-Engine spec fuses the pre-norms into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF name templates: "{e}" the global expert, "{moe}" / "{gate}" "{up}" "{down}" the
    # MoE family's names (ModelArch.hf_moe_block / hf_expert_projections)
    kind: str  # "copy" | "qkv" | "glu" | "vocab"
    tp_dim: int | None  # dimension split across TP ranks; None: replicated


# Keys are Megatron names with "decoder.layers.{i}." removed for layer parameters.
_GLOBAL_RULES: dict[str, Rule] = {
    "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), "vocab", 0),
    "decoder.final_layernorm.weight": Rule(("model.norm.weight",), "copy", None),
    "output_layer.weight": Rule(("lm_head.weight",), "vocab", 0),
}
_LAYER_RULES: dict[str, Rule] = {
    "input_layernorm.weight": Rule(("input_layernorm.weight",), "copy", None),
    "self_attention.linear_qkv.weight": Rule(
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0),
    "self_attention.linear_qkv.bias": Rule(
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", 0),
    "self_attention.q_layernorm.weight": Rule(("self_attn.q_norm.weight",), "copy", None),
    "self_attention.k_layernorm.weight": Rule(("self_attn.k_norm.weight",), "copy", None),
    "self_attention.linear_proj.weight": Rule(("self_attn.o_proj.weight",), "copy", 1),
    "pre_mlp_layernorm.weight": Rule(("post_attention_layernorm.weight",), "copy", None),
    "mlp.linear_fc1.weight": Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu", 0),
    "mlp.linear_fc2.weight": Rule(("mlp.down_proj.weight",), "copy", 1),
    "mlp.router.weight": Rule(("{moe}.gate.weight",), "copy", None),
    "mlp.shared_experts.linear_fc1.weight": Rule(
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "glu", 0),
    "mlp.shared_experts.linear_fc2.weight": Rule(("mlp.shared_expert.down_proj.weight",), "copy", 1),
    "mlp.shared_experts.gate_weight": Rule(("mlp.shared_expert_gate.weight",), "copy", None),
}
# Keys are what follows "mlp.experts.local_experts.{e}."; "{e}" in the HF names is the global expert.
_EXPERT_RULES: dict[str, Rule] = {
    "linear_fc1.weight": Rule(("{moe}.experts.{e}.{gate}.weight", "{moe}.experts.{e}.{up}.weight"), "glu", 0),
    "linear_fc2.weight": Rule(("{moe}.experts.{e}.{down}.weight",), "copy", 1),
}


class MappingError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def canonical(name: str) -> str:
    """Megatron name with Transformer-Engine aliases replaced by local-spec names."""
    m = _LAYER.match(name)
    if m and m.group(2) in _TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{_TE_ALIASES[m.group(2)]}"
    return name


def te_name(name: str) -> str:
    """Inverse of ``canonical``: the Transformer-Engine name Megatron checkpoints use for fused norms."""
    m = _LAYER.match(name)
    inverse = {v: k for k, v in _TE_ALIASES.items()}
    if m and m.group(2) in inverse:
        return f"decoder.layers.{m.group(1)}.{inverse[m.group(2)]}"
    return name


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Turn a pipeline stage's parameter name into the whole-model name.

    ``expert_offset`` is the global index of this rank's first expert (expert parallelism).
    """
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def _split_name(name: str) -> tuple[int | None, int | None, Rule]:
    """(layer, expert, rule) of a global Megatron name; layer/expert None where not applicable."""
    name = canonical(name)
    m = _LAYER.match(name)
    layer: int | None = None
    expert: int | None = None
    if m:
        layer = int(m.group(1))
        e = _EXPERT.match(m.group(2))
        if e:
            expert = int(e.group(1))
            rule = _EXPERT_RULES.get(e.group(2))
        else:
            rule = _LAYER_RULES.get(m.group(2))
    else:
        rule = _GLOBAL_RULES.get(name)
    if rule is None:
        raise MappingError(f"no HF mapping for Megatron parameter {name!r}")
    return layer, expert, rule


def _moe_names(arch: ModelArch) -> dict[str, str]:
    if not arch.is_moe:
        return {}
    gate, up, down = arch.hf_expert_projections
    return {"moe": arch.hf_moe_block, "gate": gate, "up": up, "down": down}


def hf_names(arch: ModelArch, name: str) -> tuple[str, ...]:
    """The HF tensors a Megatron parameter is made of."""
    layer, expert, rule = _split_name(name)
    if layer is None:
        return rule.hf
    return tuple(f"model.layers.{layer}.{t.format(e=expert, **_moe_names(arch))}" for t in rule.hf)


def expert_index(name: str) -> int | None:
    """The global expert a Megatron parameter belongs to; None for everything outside the experts."""
    return _split_name(name)[1]


def is_expert(name: str) -> bool:
    return expert_index(name) is not None


def with_expert(name: str, expert: int) -> str:
    """The same parameter of another expert (global names)."""
    m = _LAYER.match(canonical(name))
    e = _EXPERT.match(m.group(2)) if m else None
    if e is None:
        raise MappingError(f"{name!r} is not an expert parameter")
    return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{expert}.{e.group(2)}"


def mcore_names(arch: ModelArch) -> list[str]:
    """Every Megatron parameter name (local spec) of the whole model, in model order."""
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if arch.qkv_bias:
        per_layer.append("self_attention.linear_qkv.bias")
    if arch.qk_norm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    per_layer += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    if arch.is_moe:
        per_layer.append("mlp.router.weight")
        per_layer += [f"mlp.experts.local_experts.{e}.{p}" for e in range(arch.num_experts)
                      for p in ("linear_fc1.weight", "linear_fc2.weight")]
        if arch.shared_expert_intermediate_size:
            per_layer += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
                          "mlp.shared_experts.gate_weight"]
    else:
        per_layer += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{p}" for i in range(arch.num_layers) for p in per_layer]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_shape(arch: ModelArch, hf_name: str) -> tuple[int, ...]:
    """The shape the config implies for an HF tensor; unknown names raise MappingError."""
    h, hd = arch.hidden_size, arch.head_dim
    m = _HF_LAYER.match(hf_name)
    suffix = m.group(2) if m else hf_name
    shapes = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (arch.num_heads * hd, h),
        "self_attn.k_proj.weight": (arch.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (arch.num_kv_heads * hd, h),
        "self_attn.q_proj.bias": (arch.num_heads * hd,),
        "self_attn.k_proj.bias": (arch.num_kv_heads * hd,),
        "self_attn.v_proj.bias": (arch.num_kv_heads * hd,),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "self_attn.o_proj.weight": (h, arch.num_heads * hd),
    }
    if arch.is_moe:  # every layer is a MoE layer: no dense MLP tensors
        block, (gate, up, down) = arch.hf_moe_block, arch.hf_expert_projections
        ffn = arch.moe_intermediate_size
        shapes[f"{block}.gate.weight"] = (arch.num_experts, h)
        for e in range(arch.num_experts):
            shapes.update({f"{block}.experts.{e}.{gate}.weight": (ffn, h), f"{block}.experts.{e}.{up}.weight": (ffn, h),
                           f"{block}.experts.{e}.{down}.weight": (h, ffn)})
        shared = arch.shared_expert_intermediate_size
        if shared:
            shapes.update({"mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight":
                           (shared, h), "mlp.shared_expert.down_proj.weight": (h, shared),
                           "mlp.shared_expert_gate.weight": (1, h)})
    else:
        shapes.update({"mlp.gate_proj.weight": (arch.intermediate_size, h),
                       "mlp.up_proj.weight": (arch.intermediate_size, h),
                       "mlp.down_proj.weight": (h, arch.intermediate_size)})
    if suffix not in shapes or (m and not 0 <= int(m.group(1)) < arch.num_layers):
        raise MappingError(f"HF tensor {hf_name!r} is not part of a {arch.model_type} model")
    return shapes[suffix]


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name of the model, in checkpoint order."""
    return [hf for name in mcore_names(arch) for hf in hf_names(arch, name)]


def join(arch: ModelArch, name: str, tensors: Sequence[torch.Tensor], padded_vocab: int) -> torch.Tensor:
    """Build the full (TP-unsplit) Megatron tensor ``name`` from its HF tensors (``hf_names`` order)."""
    rule = _split_name(name)[2]
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "vocab":
        (t,) = tensors
        if padded_vocab < t.shape[0]:
            raise ValueError(f"{name}: padded vocabulary {padded_vocab} < {t.shape[0]} rows")
        pad = t.new_zeros((padded_vocab - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad])
    if rule.kind == "glu":
        return torch.cat(list(tensors))
    q, k, v = tensors
    groups = arch.num_kv_heads
    rest = q.shape[1:]
    per_group = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split(arch: ModelArch, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``join``: the HF (name, tensor) pairs a full Megatron tensor holds."""
    targets = hf_names(arch, name)
    rule = _split_name(name)[2]
    if rule.kind == "copy":
        return [(targets[0], tensor)]
    if rule.kind == "vocab":
        return [(targets[0], tensor[: arch.vocab_size])]
    if rule.kind == "glu":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return list(zip(targets, (gate, up), strict=True))
    groups, hd = arch.num_kv_heads, arch.head_dim
    q_per_group = arch.num_heads // groups * hd
    rest = tensor.shape[1:]
    grouped = tensor.reshape(groups, q_per_group + 2 * hd, *rest)
    q, k, v = torch.split(grouped, [q_per_group, hd, hd], dim=1)
    return list(zip(targets, (x.reshape(-1, *rest) for x in (q, k, v)), strict=True))


def rule_kind(name: str) -> str:
    """How the parameter's HF tensors are fused: "copy", "qkv", "glu" or "vocab"."""
    return _split_name(name)[2].kind


def tp_dim(name: str) -> int | None:
    """The dimension split over TP ranks (for experts: over expert-TP ranks); None: replicated."""
    return _split_name(name)[2].tp_dim


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor (fused gate/up: each rank holds both halves).

    For expert tensors pass the expert-tensor-parallel rank and size.
    """
    rule = _split_name(name)[2]
    if rule.tp_dim is None or tp_size == 1:
        return full
    if rule.kind == "glu":
        halves = [torch.chunk(h, tp_size, dim=0)[tp_rank] for h in torch.chunk(full, 2, dim=0)]
        return torch.cat(halves)
    if full.shape[rule.tp_dim] % tp_size:
        raise ValueError(f"{name}: dimension {rule.tp_dim} of {tuple(full.shape)} does not split into {tp_size}")
    return torch.chunk(full, tp_size, dim=rule.tp_dim)[tp_rank]


def gather(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from every TP rank's slice, in rank order."""
    rule = _split_name(name)[2]
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "glu":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=rule.tp_dim)


def to_hf(arch: ModelArch, named_full: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of full Megatron tensors, one Megatron tensor at a time.

    With tied embeddings the output layer is skipped: HF keeps only ``model.embed_tokens``.
    """
    for name, tensor in named_full:
        if arch.tie_word_embeddings and canonical(name) == "output_layer.weight":
            continue
        yield from split(arch, name, tensor)


def check_ep(arch: ModelArch, ep_size: int, etp_size: int) -> None:
    """Refuse an expert-parallel layout the model's experts cannot be split into."""
    if not arch.is_moe:
        if ep_size != 1 or etp_size != 1:
            raise ValueError(f"parallel.ep={ep_size} / parallel.etp={etp_size}: {arch.model_type} has no experts; "
                             "expert parallelism needs a MoE model (ep=1, etp=1)")
        return
    if arch.num_experts % ep_size:
        raise ValueError(f"parallel.ep={ep_size} must divide the model's num_experts={arch.num_experts}")
    if arch.moe_intermediate_size % etp_size:
        raise ValueError(f"parallel.etp={etp_size} must divide the model's "
                         f"moe_intermediate_size={arch.moe_intermediate_size}")
