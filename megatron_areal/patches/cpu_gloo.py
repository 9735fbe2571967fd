"""Run megatron-core 0.16.1 on CPU with gloo by redirecting its CUDA assumptions.

Megatron-core hard-codes CUDA in three ways that a CPU run trips over:

1. tensors allocated with ``device="cuda"`` / ``torch.cuda.current_device()`` / ``.cuda()`` on
   the forward, backward and optimizer paths (about 35 reached sites);
2. the model-parallel RNG tracker reads and writes the CUDA generator;
3. string dtype checks such as ``param.type() == 'torch.cuda.FloatTensor'`` in the optimizers,
   and the local-spec norm refusing sequence parallelism.

(1) is handled by wrapping torch's tensor factories, ``Tensor.new_*``, ``Tensor.cuda`` and
``Tensor.to`` so a CUDA device becomes the CPU (a ``TorchFunctionMode`` cannot do it: it is not
active inside custom autograd backward functions). Every redirected call records its caller, so
``CpuPatch.redirected_sites()`` lists the megatron-core lines that really asked for CUDA.
(2) and (3) are source edits of named functions (``SOURCE_EDITS``): each edit checks that the
text it replaces is still there, so a megatron-core release that moves a site fails loudly with
``PatchError`` instead of silently running unpatched code.

The patch is process-wide (it rebinds attributes of torch and megatron-core), so it is applied
only when the CPU/gloo backend is selected: ``apply_cpu_patch()`` once per process, ``remove()``
to restore everything (tests do this).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_areal.patches.version import MEGATRON_CORE_VERSION

log = logging.getLogger(__name__)

PINNED_VERSION = MEGATRON_CORE_VERSION


class PatchError(RuntimeError):
    """The installed megatron-core does not match what the CPU patch was written against."""


@dataclass(frozen=True)
class SourceEdit:
    """Replace ``old`` by ``new`` in the source of ``module.qualname`` (``count`` occurrences)."""

    module: str
    qualname: str
    old: str
    new: str
    why: str
    count: int = 1

    @property
    def site(self) -> str:
        return f"{self.module}.{self.qualname}"


_TP_RANDOM = "megatron.core.tensor_parallel.random"
_CUDA_TYPES = {"torch.cuda.FloatTensor": "torch.FloatTensor", "torch.cuda.HalfTensor": "torch.HalfTensor",
               "torch.cuda.BFloat16Tensor": "torch.BFloat16Tensor"}


def _type_edits(module: str, qualname: str, names: tuple[str, ...], counts: tuple[int, ...]) -> list[SourceEdit]:
    return [SourceEdit(module, qualname, f"'{n}'", f"'{_CUDA_TYPES[n]}'", "CPU tensors report CPU type names", c)
            for n, c in zip(names, counts)]


SOURCE_EDITS: tuple[SourceEdit, ...] = (
    SourceEdit(_TP_RANDOM, "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state()", "torch.get_rng_state()",
               "tracker states are CPU generator states", count=2),
    SourceEdit(_TP_RANDOM, "CudaRNGStatesTracker.add", "torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)",
               "seed the CPU generator"),
    SourceEdit(_TP_RANDOM, "model_parallel_cuda_manual_seed", "torch.cuda.manual_seed(data_parallel_seed)",
               "torch.manual_seed(data_parallel_seed)", "the default state is the CPU generator"),
    *_type_edits("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                 ("torch.cuda.FloatTensor",), (1,)),
    *_type_edits("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
                 ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor"), (1, 1, 1)),
    *_type_edits("megatron.core.optimizer.distrib_optimizer",
                 "DistributedOptimizer._build_model_and_main_param_groups",
                 ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor"), (1, 1, 1)),
    *_type_edits("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                 ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"), (1, 1)),
    SourceEdit("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
               'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"',
               "pass", "torch norms are correct under sequence parallelism once their grads are reduced"),
    SourceEdit("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
               "return norm_cls(normalized_shape=hidden_size, eps=eps)",
               "return _local_spec_norm(config, norm_cls, hidden_size, eps)",
               "RMSNorm weights in params_dtype with a lean backward (patches/rms_norm.py), marked for SP"),
    # The MoE all-to-all dispatcher turns its split sizes into host numpy arrays through this
    # helper, which skips tensors that are not on CUDA; torch.distributed.all_to_all_single then
    # refuses the CPU tensors as split sizes ("incompatible function arguments").
    SourceEdit("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
               "if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor):",
               "the all-to-all split sizes become host numpy arrays as on CUDA"),
    # With expert tensor parallelism the dispatcher all-gathers differently sized token blocks;
    # gloo's all_gather refuses tensors of different sizes ("invalid tensor size at index 1").
    SourceEdit("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
               "torch.distributed.all_gather(output_tensor_list, input_, group=group)",
               "_host_all_gather_uneven(output_tensor_list, input_, group=group)",
               "gloo gathers equal blocks: pad to the largest, then cut"),
)
# Names that edited sources call, injected into the edited function's module.
_INJECTED = {"megatron.core.tensor_parallel.mappings": "_host_all_gather_uneven",
             "megatron.core.transformer.torch_norm": "_local_spec_norm"}


def _local_spec_norm(config: Any, norm_cls: type, hidden_size: int, eps: float) -> torch.nn.Module:
    """The local spec's norm: ours for RMSNorm (weight in ``params_dtype``, as Megatron's GPU paths
    have it, and a lean backward), torch's otherwise. Its weights are tagged so finalize_model_grads
    all-reduces their grads over the TP group, which sequence parallelism needs because each TP rank
    normalised only its slice of the sequence."""
    from megatron_areal.patches.rms_norm import RMSNorm

    if norm_cls is torch.nn.RMSNorm:
        norm = RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    else:
        norm = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


def _host_all_gather_uneven(outputs: list[torch.Tensor], input_: torch.Tensor, group: Any = None) -> None:
    """``all_gather`` into differently sized ``outputs`` (first dimension) over gloo."""
    import torch.distributed as dist

    longest = max(o.shape[0] for o in outputs)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    blocks = [torch.empty_like(padded) for _ in outputs]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    for out, block in zip(outputs, blocks, strict=True):
        out.copy_(block[: out.shape[0]])

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "rand", "randn",
              "randint", "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided")
_TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
_CUDA_NOOPS = ("synchronize", "set_device", "empty_cache")


class _HostEvent:
    def synchronize(self) -> None:
        pass


class _HostStream:
    """The one stream of a CPU process: the MoE all-to-all dispatcher copies its token counts to the
    host on a side CUDA stream and waits for an event; on the CPU everything is already in order."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()
_INHERITED = object()  # marks a class attribute that was inherited, not set on the class itself


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _resolve(module: str, qualname: str) -> tuple[Any, Any, str]:
    """Return (owner object, function, attribute name) for ``module.qualname``."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as e:
        raise PatchError(f"megatron-core CPU patch: cannot import {module}: {e}") from None
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise PatchError(f"megatron-core CPU patch: {module}.{qualname}: {part} no longer exists")
    func = owner.__dict__.get(parts[-1]) if isinstance(owner, type) else getattr(owner, parts[-1], None)
    if func is None:
        raise PatchError(f"megatron-core CPU patch: {module}.{qualname} no longer exists")
    return owner, func, parts[-1]


def _recompile(func: Any, source: str, owner: Any, name: str) -> Any:
    """Compile edited ``source`` of ``func`` in its module's namespace, keeping file and line numbers.

    The definition is wrapped in a factory taking ``__class__`` so zero-argument ``super()``
    inside methods keeps working.
    """
    raw = func.__func__ if isinstance(func, (staticmethod, classmethod)) else func
    code = raw.__code__
    body = textwrap.indent(textwrap.dedent(source), "    ")
    wrapper = "\n" * max(code.co_firstlineno - 2, 0) + f"def _factory(__class__):\n{body}\n    return {name}\n"
    namespace: dict[str, Any] = {}
    exec(compile(wrapper, code.co_filename, "exec"), raw.__globals__, namespace)
    new = namespace["_factory"](owner if isinstance(owner, type) else None)
    return type(func)(new) if isinstance(func, (staticmethod, classmethod)) else new


@dataclass
class CpuPatch:
    """The applied redirect: what it replaced (to undo it) and the CUDA calls it redirected."""

    edited_sites: list[str] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    calls: collections.Counter = field(default_factory=collections.Counter)
    _originals: list[tuple[Any, str, Any]] = field(default_factory=list)

    def redirected_sites(self, only_megatron: bool = True) -> dict[str, int]:
        """Call sites (``file:line``) that asked for a CUDA device, with how often."""
        return {k: v for k, v in sorted(self.calls.items()) if not only_megatron or "megatron/core" in k}

    def _set(self, owner: Any, name: str, value: Any) -> None:
        # For classes keep the class's own entry (or _INHERITED) so removal restores inheritance;
        # a name the owner lacked (_INHERITED too) is deleted again on removal.
        original = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name, _INHERITED)
        self._originals.append((owner, name, original))
        setattr(owner, name, value)

    def _record(self) -> None:
        frame = sys._getframe(2)
        self.calls[f"{frame.f_code.co_filename}:{frame.f_lineno}"] += 1

    def _wrap_factory(self, owner: Any, name: str) -> None:
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if _is_cuda(kwargs.get("device")):
                self._record()
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return orig(*args, **kwargs)

        self._set(owner, name, factory)
        self.wrapped.append(f"{owner.__name__}.{name}")

    def _wrap_to(self) -> None:
        orig = torch.Tensor.to

        @functools.wraps(orig)
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args and _is_cuda(args[0]):
                self._record()
                args = ("cpu", *args[1:])
            if _is_cuda(kwargs.get("device")):
                self._record()
                kwargs["device"] = "cpu"
            return orig(tensor, *args, **kwargs)

        def cuda(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self._record()
            return tensor

        self._set(torch.Tensor, "to", to)
        self._set(torch.Tensor, "cuda", cuda)
        self.wrapped += ["Tensor.to", "Tensor.cuda"]

    def _stub_cuda(self) -> None:
        self._set(torch.cuda, "current_device", lambda: 0)
        for name in _CUDA_NOOPS:
            self._set(torch.cuda, name, lambda *a, **k: None)
        self.wrapped += ["torch.cuda.current_device", *(f"torch.cuda.{n}" for n in _CUDA_NOOPS)]
        # Side and current stream are the same object, so the dispatcher never records a tensor on
        # another stream.
        self._set(torch.cuda, "Stream", lambda *a, **k: _HOST_STREAM)
        self._set(torch.cuda, "current_stream", lambda *a, **k: _HOST_STREAM)
        self._set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        self.wrapped += ["torch.cuda.Stream", "torch.cuda.current_stream", "torch.cuda.stream"]

    def _redirect_rng(self) -> None:
        random = importlib.import_module(_TP_RANDOM)
        for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
            if not callable(getattr(random, name, None)):
                raise PatchError(f"megatron-core CPU patch: {_TP_RANDOM}.{name} no longer exists")
        self._set(random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        self._set(random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
        self.wrapped += [f"{_TP_RANDOM}._get_cuda_rng_state", f"{_TP_RANDOM}._set_cuda_rng_state"]

    def _apply_edits(self, edits: tuple[SourceEdit, ...]) -> None:
        for module, name in _INJECTED.items():
            if any(e.module == module for e in edits):
                self._set(importlib.import_module(module), name, globals()[name])
        by_site: dict[str, list[SourceEdit]] = collections.defaultdict(list)
        for edit in edits:
            by_site[edit.site].append(edit)
        for site, site_edits in by_site.items():
            owner, func, name = _resolve(site_edits[0].module, site_edits[0].qualname)
            source = inspect.getsource(func.__func__ if isinstance(func, (staticmethod, classmethod)) else func)
            for edit in site_edits:
                found = source.count(edit.old)
                if found != edit.count:
                    raise PatchError(f"megatron-core CPU patch: {site}: expected {edit.count} x {edit.old!r}, "
                                     f"found {found}; the site moved (pinned megatron-core {PINNED_VERSION})")
                source = source.replace(edit.old, edit.new)
            new = _recompile(func, source, owner, name)
            self._set(owner, name, new)
            if not isinstance(owner, type):
                self._rebind_imports(func, new)
            self.edited_sites.append(site)

    def _rebind_imports(self, old: Any, new: Any) -> None:
        """``from x import f`` copied the function into other modules; point those names at ``new``."""
        for mod_name, module in list(sys.modules.items()):
            if not mod_name.startswith("megatron.") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if value is old:
                    self._set(module, attr, new)

    def remove(self) -> None:
        """Restore every attribute this patch replaced, newest first."""
        for owner, name, value in reversed(self._originals):
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._originals.clear()


_ACTIVE: CpuPatch | None = None


def check_version() -> str:
    from megatron.core import package_info

    if package_info.__version__ != PINNED_VERSION:
        raise PatchError(f"megatron-core {package_info.__version__} is installed; the CPU patch is written "
                         f"against {PINNED_VERSION} (pip install megatron-core=={PINNED_VERSION})")
    return package_info.__version__


def apply_cpu_patch(edits: tuple[SourceEdit, ...] = SOURCE_EDITS) -> CpuPatch:
    """Apply the redirect once per process (idempotent); returns the active patch."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    check_version()
    patch = CpuPatch()
    try:
        patch._apply_edits(edits)
        patch._redirect_rng()
        for name in _FACTORIES:
            patch._wrap_factory(torch, name)
        for name in _TENSOR_NEW:
            patch._wrap_factory(torch.Tensor, name)
        patch._wrap_to()
        patch._stub_cuda()
    except BaseException:
        patch.remove()
        raise
    log.info("megatron-core CPU patch: %d edited functions, %d redirected torch entry points",
             len(patch.edited_sites), len(patch.wrapped))
    _ACTIVE = patch
    return patch


def active_patch() -> CpuPatch | None:
    return _ACTIVE


def remove_cpu_patch() -> None:
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.remove()
        _ACTIVE = None

