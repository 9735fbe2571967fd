"""Low-rank adapters beside Megatron-core's column- and row-parallel linear layers (``model.lora``).

Every targeted HF projection gets a pair ``A [rank, in]``, ``B [out, rank]`` and adds
``dropout(x) @ A.T @ B.T * alpha / rank`` to the projection's output, as PEFT's ``LoraLayer`` does. The pairs
live in one module, ``chunk.lora`` (so Megatron DDP and the optimizer see them, and the base model's
parameter names stay those of ``model/mapping.py``), and act through forward hooks on the linear layers.

Tensor parallelism, sharded the way the base weight is:

- column-parallel (``linear_qkv``, ``linear_fc1``: output rows split over TP): ``A`` whole on every rank,
  ``B`` split by rows. ``h = x @ A.T`` is the same on every rank; its gradient is a sum of every rank's
  ``B`` shard, so ``h`` passes Megatron's copy-to-TP region (identity forward, all-reduce backward): ``A``'s
  gradient is then whole and equal on every rank.
- row-parallel (``linear_proj``, ``linear_fc2``: input columns split): ``A`` split by columns, ``B`` whole.
  ``h = x_shard @ A_shard.T`` is a partial sum, all-reduced (reduce-from-TP region) before ``B``.

Fused layers keep one pair per projection; their updates are laid out as the fused weight is
(``mapping.join``: per KV group q, k, v rows; gate then up). ``B`` starts at zero, so the adapted model
starts equal to the base. The base weights are frozen (``requires_grad`` off): Megatron DDP gives them no
gradient buffer and the optimizer no state.

Limits: Megatron's local layer spec only (Transformer Engine's linear layers fuse the norm into the
projection, so its input is not the projection's), no sequence parallelism, no adapters on MoE experts.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)

from megatron_areal.actor.config import LoraConfig
from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.lora_sites import Site, check_targets, hf_shape, hf_weight_name, sites
from megatron_areal.model.weights import ADAPTERS, unwrap

log = logging.getLogger(__name__)


class LoraPair(torch.nn.Module):
    """One projection's adapter on this TP rank."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, split: str) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)
        self.split = split  # "A" or "B": the matrix split over TP ranks (the other is whole on every rank)
        sharded = self.A if split == "A" else self.B
        set_tensor_model_parallel_attributes(sharded, True, 1 if split == "A" else 0, 1)


def _full_a(seed: int, layer: int, target: str, rank: int, in_features: int) -> torch.Tensor:
    """PEFT's default ``A`` (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), the same at any layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{layer}.{target}".encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound


class LoraAdapters(torch.nn.Module):
    """The adapters of one pipeline stage: ``layers[str(global layer)][target]`` -> ``LoraPair``."""

    def __init__(self, arch: ModelArch, cfg: LoraConfig, layers: dict[int, torch.nn.Module], *, tp: int,
                 tp_rank: int, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch, self.cfg, self.tp, self.scale = arch, cfg, tp, cfg.scale
        self.sites = [s for s in sites(arch) if set(s.targets) & set(cfg.targets)]
        # this rank's shard of the fused layers seen as a model of its own: mapping.join lays out its rows
        self._local_arch = dataclasses.replace(arch, num_heads=arch.num_heads // tp,
                                               num_kv_heads=arch.num_kv_heads // tp)
        self.layers = torch.nn.ModuleDict()
        self._by_hf_name: dict[str, tuple[int, str]] = {}
        for layer, module in layers.items():
            pairs = torch.nn.ModuleDict()
            for site in self.sites:
                for target, hf_module in zip(site.targets, site.hf_modules, strict=True):
                    if target not in cfg.targets:
                        continue
                    out_f, in_f = hf_shape(arch, hf_module)
                    a = _full_a(seed, layer, target, cfg.rank, in_f)
                    if not site.column:
                        a = torch.chunk(a, tp, dim=1)[tp_rank]
                    b = torch.zeros(out_f // tp if site.column else out_f, cfg.rank)
                    pairs[target] = LoraPair(a.to(device, dtype).contiguous(), b.to(device, dtype),
                                             "B" if site.column else "A")
                    self._by_hf_name[hf_weight_name(layer, hf_module)] = (layer, target)
                linear = _submodule(module, site.megatron)
                if not isinstance(linear, ColumnParallelLinear | RowParallelLinear):
                    raise ValueError(f"model.lora needs Megatron's local layer spec (model.transformer_impl: local): "
                                     f"{site.megatron} is a {type(linear).__name__}, whose input is not the "
                                     "projection's input")
                linear.register_forward_hook(functools.partial(self._add_update, str(layer), site))
            self.layers[str(layer)] = pairs

    # ------------------------------------------------------------------ forward
    def _add_update(self, layer: str, site: Site, module: torch.nn.Module, args: tuple[Any, ...],
                    output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        out, bias = output
        x = F.dropout(args[0], self.cfg.dropout, self.training)
        pairs = self.layers[layer]
        if site.column:
            updates = []
            for target, hf_module in zip(site.targets, site.hf_modules, strict=True):
                if target in pairs:
                    h = copy_to_tensor_model_parallel_region(F.linear(x, pairs[target].A))
                    updates.append(F.linear(h, pairs[target].B))
                else:
                    updates.append(x.new_zeros(*x.shape[:-1], hf_shape(self.arch, hf_module)[0] // self.tp))
            update = mapping.join(self._local_arch, site.weight_name(0), [u.movedim(-1, 0) for u in updates],
                                  0).movedim(0, -1)
        else:
            pair = pairs[site.targets[0]]
            update = F.linear(reduce_from_tensor_model_parallel_region(F.linear(x, pair.A)), pair.B)
        return out + update * self.scale, bias

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict[str, Any]:
        """Global tensors keyed by global layer (``lora_sites.checkpoint_key``), split as on this rank, so a
        checkpoint loads at any TP/PP layout."""
        from megatron.core.transformer.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        out: dict[str, Any] = {}
        for layer, pairs in self.layers.items():
            for target, pair in pairs.items():
                for matrix in ("A", "B"):
                    key = f"{prefix}layers.{layer}.{target}.{matrix}"
                    param = getattr(pair, matrix)
                    if matrix == pair.split:
                        out[key] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=1 if matrix == "A" else 0)
                    else:
                        out[key] = make_sharded_tensor_for_checkpoint(param, key)
        return out

    # ------------------------------------------------------------------ export
    @torch.no_grad()
    def full_pair(self, layer: int, target: str, tp_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
        """Whole ``A`` and ``B`` of one projection (collective over the TP group)."""
        pair = self.layers[str(layer)][target]
        whole = []
        for matrix in ("A", "B"):
            local = getattr(pair, matrix).detach()
            if matrix == pair.split and self.tp > 1:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
                local = torch.cat(shards, dim=1 if matrix == "A" else 0)
            whole.append(local)
        return tuple(whole)

    def whole_pairs(self, tp_group: dist.ProcessGroup | None) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(HF weight name, whole ``A``, whole ``B``) of every adapted projection of this stage, in the same order
        on every rank (collective over the TP group)."""
        for hf_name, (layer, target) in self._by_hf_name.items():
            a, b = self.full_pair(layer, target, tp_group)
            yield hf_name, a, b

    def hf_updates(self, name: str, tp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """HF name -> whole fp32 update ``B @ A * scale`` of each adapted projection inside the global Megatron
        parameter ``name`` (empty for others). Collective over the TP group where ``name`` is adapted: every
        rank of the group calls it for the same names in the same order."""
        if mapping.is_expert(name) or ".weight" not in name:
            return {}
        out = {}
        for hf_name in mapping.hf_names(self.arch, name):
            hit = self._by_hf_name.get(hf_name)
            if hit is not None:
                a, b = self.full_pair(*hit, tp_group)
                out[hf_name] = b.float() @ a.float() * self.scale
        return out


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _require_grad(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on its gradient with row-major strides.

    A frozen Megatron linear layer's backward is ``grad_output.matmul(weight)`` (``LinearWithFrozenWeight``).
    The output layer's gradient arrives as a transposed view (``[s, 1, vocab]``, the sequence stride
    outermost), which ``torch.matmul`` cannot fold into one matrix product: it broadcasts the weight over the
    sequence and materialises ``[s, vocab, hidden]`` (25 GB at SmolLM2's shapes, 448 tokens). A trained
    weight's backward reshapes to 2-D itself, so only a LoRA run (frozen base) meets it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # is_contiguous() ignores the stride of a size-1 dim, and so does contiguous(); the 2-D view resets it
        return grad.contiguous().view(-1, grad.shape[-1]).view(grad.shape)


def _contiguous_grad_output(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, Any]
                            ) -> tuple[torch.Tensor, Any]:
    out, bias = output
    return _ContiguousGrad.apply(out), bias


def attach_lora(chunks: Sequence[torch.nn.Module], arch: ModelArch, cfg: LoraConfig, *, tp: int, tp_rank: int,
                seed: int, sequence_parallel: bool = False, recompute: bool = False) -> None:
    """Freeze the chunks' weights and put adapters beside their targeted projections (before DDP wraps them).

    ``recompute``: Megatron recomputes each layer in a checkpoint function that runs a backward only when its
    input requires a gradient; with a frozen embedding none does, so the first stage's embedding output is
    marked as requiring one (later stages receive theirs so marked)."""
    check_targets(arch, cfg.targets)
    if sequence_parallel:
        raise ValueError("model.lora does not support parallel.sequence_parallel (the adapters take the "
                         "projection's whole input); set parallel.sequence_parallel: false")
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        if recompute and getattr(chunk, "pre_process", False):
            chunk.embedding.register_forward_hook(_require_grad)
        layers = {int(layer.layer_number) - 1: layer for layer in chunk.decoder.layers}
        ref = next(chunk.parameters())
        setattr(chunk, ADAPTERS, LoraAdapters(arch, cfg, layers, tp=tp, tp_rank=tp_rank, seed=seed, dtype=ref.dtype,
                                          device=ref.device))
        # after the adapters' hooks, so a frozen layer's backward gets the gradient of base + update contiguous
        for module in chunk.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.register_forward_hook(_contiguous_grad_output)
        trainable = sum(p.numel() for p in chunk.parameters() if p.requires_grad)
        log.info("model.lora: rank %d on %s; %d trainable parameters on this rank", cfg.rank,
                 ",".join(cfg.targets), trainable)


def adapters_of(chunk: torch.nn.Module) -> LoraAdapters | None:
    found = getattr(unwrap(chunk), ADAPTERS, None)
    return found if isinstance(found, LoraAdapters) else None


def lora_settings(chunks: Sequence[torch.nn.Module]) -> dict[str, Any] | None:
    """The ``model.lora`` section a model's adapters were built from (checkpoint metadata); None without."""
    for chunk in chunks:
        adapters = adapters_of(chunk)
        if adapters is not None:
            return dataclasses.asdict(adapters.cfg)
    return None
