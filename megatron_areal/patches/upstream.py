"""The index of our changes to third-party code, and the check that the pinned upstream still has what
each change relies on.

A change is applied where it is used (the module in ``applied_by``); this module only describes it and
checks it. The check reads the upstream's installed source files as text, so it sees the upstream as
shipped even in a process where a change is already applied.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.patches.cpu_gloo import SOURCE_EDITS
from megatron_areal.patches.version import MEGATRON_CORE_VERSION

MEGATRON_CORE = ("megatron-core", MEGATRON_CORE_VERSION)


class UpstreamChanged(RuntimeError):
    """The installed upstream is not the version a change is written against, or lacks a site it patches."""


@dataclass(frozen=True)
class Expect:
    """``text`` occurs in the source file of ``module`` (as installed)."""

    module: str
    text: str


@dataclass(frozen=True)
class Change:
    """One change to third-party behaviour."""

    name: str
    upstream: str  # the distribution, as pip names it
    version: str  # the version the change is written against (patches/version.py; setup.py reads it)
    why: str
    applied_by: str  # repository path of the module that applies it, and when
    expects: tuple[Expect, ...]


_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_ROPE = "megatron.core.models.common.embeddings.rope_utils"
_DISTRIB = "megatron.core.optimizer.distrib_optimizer"

CHANGES: tuple[Change, ...] = (
    Change("cpu-gloo", *MEGATRON_CORE,
           why="megatron-core assumes CUDA (device='cuda' allocations, the CUDA RNG tracker, CUDA type-name "
               "checks, gloo's equal-size all_gather); redirected so TP/PP/DP/EP/SP run on CPU with gloo",
           applied_by="megatron_areal/patches/cpu_gloo.py: apply_cpu_patch(), by init_parallel on gloo only",
           expects=tuple(Expect(edit.module, edit.old) for edit in SOURCE_EDITS)),
    Change("moe-router-without-te", *MEGATRON_CORE,
           why="RouterGatingLinearFunction tests te_general_gemm, which moe_utils defines only when Transformer "
               "Engine imports; defined as None, the router takes its own torch.mm branch",
           applied_by="megatron_areal/patches/moe_router.py: ensure_router_gemm_fallback(), by build_model for MoE",
           expects=(Expect(_MOE_UTILS, "class RouterGatingLinearFunction(torch.autograd.Function):"),
                    Expect(_MOE_UTILS, "if te_general_gemm is not None and router_dtype != torch.float64:"))),
    Change("packed-rope-table", *MEGATRON_CORE,
           why="the reference thd rotary path rebuilds cos/sin for every q and k of every layer; the same values "
               "from one table per micro-batch (a fifth of the CPU forward)",
           applied_by="megatron_areal/patches/packed_rope.py: install(), by build_model for the local spec",
           expects=(Expect(_ROPE, "def _apply_rotary_pos_emb_thd(\n    t: Tensor,\n    cu_seqlens: Tensor,\n"
                                  "    freqs: Tensor,\n    rotary_interleaved: bool = False,\n"
                                  "    multi_latent_attention: bool = False,\n    mscale: float = 1.0,\n"),
                    Expect(_ROPE, "return _apply_rotary_pos_emb_thd("),  # looked up by name at call time
                    Expect(_ROPE, "def _rotate_half(x: Tensor, rotary_interleaved: bool) -> Tensor:"))),
    Change("bf16-stochastic-rounding", *MEGATRON_CORE,
           why="an update of about lr is below bf16's spacing, so round-to-nearest from the fp32 master drops most "
               "updates; the distributed optimizer's master-to-bf16 copy is redone with stochastic rounding",
           applied_by="megatron_areal/patches/bf16_rounding.py: use_stochastic_rounding(), by build_train_state "
                      "(optimizer.bf16_rounding: stochastic)",
           expects=(Expect(_DISTRIB, "def _copy_main_params_to_model_params(self):"),
                    Expect(_DISTRIB, "def _get_model_param_range_map(self, param: torch.nn.Parameter):"),
                    Expect(_DISTRIB, '"gbuf_world_in_bucket"'),
                    Expect(_DISTRIB, "self.model_param_gbuf_map = "),
                    Expect(_DISTRIB, "self.shard_fp32_from_float16_groups"))),
    Change("precision-aware-adam-without-te", *MEGATRON_CORE,
           why="megatron-core enables its precision-aware distributed optimizer only with Transformer Engine's "
               "FusedAdam; our PrecisionAwareAdam is handed in where get_megatron_optimizer looks for it",
           applied_by="megatron_areal/patches/precision_aware_without_te.py: inner_adam(), while build_train_state "
                      "builds the optimizer (optimizer.precision_aware: true)",
           expects=(Expect("megatron.core.optimizer", "USING_PYTORCH_OPTIMIZER = True"),
                    Expect("megatron.core.optimizer", "if USING_PYTORCH_OPTIMIZER:"),
                    Expect("megatron.core.optimizer", 'is_te_min_version("2.1.0.dev0")'),
                    Expect("megatron.core.optimizer", "adam_cls = Adam"))),
    Change("checkpoint-writes-in-place", *MEGATRON_CORE,
           why="the async checkpoint writer clones every CPU tensor that views a larger storage before forking; "
               "handed exact-storage aliases it writes the same bytes without the copies",
           applied_by="megatron_areal/patches/checkpoint_writer.py: written_in_place(), by the Checkpointer around "
                      "each save",
           expects=(Expect("megatron.core.dist_checkpointing.strategies.torch",
                           "class MCoreSavePlanner(DefaultSavePlanner):"),
                    Expect("megatron.core.dist_checkpointing.strategies.filesystem_async",
                           "_clone_if_needed(planner.resolve_data(item))"))),
    Change("optimizer-state-views", *MEGATRON_CORE,
           why="at data-parallel size 1 the distributed optimizer gathers its whole fp32 state into new tensors to "
               "save it and allocates them again to load; views of its own tensors describe the same state",
           applied_by="megatron_areal/patches/optimizer_state_views.py: state_as_views(), by the Checkpointer "
                      "around each save and load",
           expects=(Expect(_DISTRIB, "def sharded_param_state_fully_reshardable(\n        self,\n"
                                     "        model_sharded_state_dict: ShardedStateDict,\n"
                                     "        is_loading: bool = False,\n        metadata: Optional[dict] = None,\n"),
                    Expect(_DISTRIB, "param_state = self.sharded_param_state_fully_reshardable(\n"
                                     "                model_sharded_state_dict, is_loading, metadata\n"),
                    Expect(_DISTRIB, "def _get_main_param_and_optimizer_states(self, model_param):"))),
)


def source_of(module: str) -> str:
    """The installed source text of ``module`` (read from its file, not from the live, possibly patched, objects)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise UpstreamChanged(f"module {module} is not installed as source")
    return Path(spec.origin).read_text()


def problems(change: Change, installed: str | None = None) -> list[str]:
    """What no longer holds for ``change`` in the installed upstream; empty when all does. ``installed``: the
    upstream's version as installed (read from its distribution's metadata when None)."""
    found = []
    if installed is None:
        try:
            installed = importlib.metadata.version(change.upstream)
        except importlib.metadata.PackageNotFoundError:
            return [f"{change.name}: {change.upstream} is not installed"]
    if installed != change.version:
        found.append(f"{change.name}: {change.upstream} {installed} is installed; the change is written against "
                     f"{change.version} ({change.applied_by}; pip install {change.upstream}=={change.version})")
    sources: dict[str, str] = {}
    for expect in change.expects:
        try:
            text = sources.setdefault(expect.module, source_of(expect.module))
        except UpstreamChanged as e:
            found.append(f"{change.name}: {e}")
            continue
        if expect.text not in text:
            found.append(f"{change.name}: {expect.module} no longer contains {expect.text!r} ({change.applied_by})")
    return found


def check(changes: tuple[Change, ...] | None = None, installed: Mapping[str, str] | None = None) -> None:
    """Raise ``UpstreamChanged`` listing every fact that no longer holds for ``changes`` (all of ``CHANGES``
    when None, read at the call). ``installed`` maps a distribution to its version where the caller knows it
    (else the installed metadata is read). The trainer runs this before it starts (``trainer/__main__.py``)."""
    installed = installed or {}
    found = [p for change in (CHANGES if changes is None else changes)
             for p in problems(change, installed.get(change.upstream))]
    if found:
        raise UpstreamChanged("the installed upstream differs from what our changes are written against:\n  "
                              + "\n  ".join(found))
