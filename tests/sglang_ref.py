"""SGLang's own code, loaded at test time from the installed ``sglang`` wheel (``--no-deps``).

SGLang's package ``__init__`` and its heavy modules import CUDA-era packages (triton, tvm_ffi,
flashinfer, the multimodal stack) that do not install on a CPU machine, so two loaders reach
its code without them:

- ``module(name)`` imports a light module (one whose own imports are torch, msgspec and
  similar) from its file, under its real dotted name, without running the parent packages'
  ``__init__``: e.g. ``sglang.srt.weight_sync.tensor_bucket``, ``sglang.srt.utils.weight_versions``.
- ``definitions(name, symbols)`` compiles just the named top-level definitions (functions,
  classes, assignments) of a heavy module's source file, in order, into a module of that name:
  e.g. ``init_custom_process_group`` from ``sglang/srt/utils/common.py`` (whose module imports
  triton) and the request classes of ``sglang/srt/managers/io_struct.py`` (whose module imports
  the scheduler). The code that runs is the wheel's, byte for byte; nothing is copied here.

Install the references with ``bash scripts/install_test_refs.sh`` (CI does).
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import sys
import types
import typing
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = "install the test references: bash scripts/install_test_refs.sh"


@functools.cache
def root() -> Path:
    """The installed ``sglang`` package directory, checked to be the pinned release."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"sglang=={SGLANG_VERSION} is not installed; {INSTALL_HINT}")
    if dist.version != SGLANG_VERSION:
        pytest.fail(f"sglang {dist.version} is installed; the conformance tests read {SGLANG_VERSION}; "
                    + INSTALL_HINT)
    return Path(str(dist.locate_file("sglang")))


def source_path(name: str) -> Path:
    path = root().joinpath(*name.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        pytest.fail(f"{name}: no {path} in sglang {SGLANG_VERSION}")
    return path


def _parents(name: str) -> None:
    """Register the parent packages as bare packages (their ``__init__`` is not run)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in sys.modules and getattr(sys.modules[pkg], "__sglang_ref__", False):
            continue
        module = types.ModuleType(pkg)
        module.__path__ = [str(root().joinpath(*parts[1:i]))]
        module.__sglang_ref__ = True  # type: ignore[attr-defined]
        sys.modules[pkg] = module


def module(name: str) -> types.ModuleType:
    """Import one light module of the wheel from its file."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", "").startswith(str(root())):
        return sys.modules[name]
    _parents(name)
    spec = importlib.util.spec_from_file_location(name, source_path(name))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def definitions(name: str, symbols: list[str], env: dict[str, object] | None = None) -> types.ModuleType:
    """The named top-level definitions of a heavy module, compiled from the wheel's source.

    ``env`` supplies the names those definitions use from the module's imports; ``typing``'s
    names are always there. Raises if a symbol is not defined at the top level of the file.
    """
    path = source_path(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    wanted, found = set(symbols), set()
    body = []
    for node in tree.body:
        defined = _defined_names(node)
        if defined & wanted:
            body.append(node)
            found |= defined & wanted
    missing = wanted - found
    if missing:
        pytest.fail(f"{name}: sglang {SGLANG_VERSION} defines no {sorted(missing)} at top level")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__dict__.update({k: getattr(typing, k) for k in typing.__all__})
    mod.__dict__.update(env or {})
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    code = compile(ast.fix_missing_locations(ast.Module(body=[future, *body], type_ignores=[])), str(path), "exec")
    _parents(name)
    sys.modules[name] = mod
    exec(code, mod.__dict__)  # noqa: S102 - the wheel's own definitions, see the module docstring
    return mod


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


# ---- the pieces the conformance tests use ----------------------------------------------------

def init_custom_process_group():
    """SGLang's receiving side of the weight-update group (``sglang/srt/utils/common.py``)."""
    import torch
    from packaging import version as pkg_version

    mod = definitions("sglang.srt.utils.common", ["torch_release", "init_custom_process_group"],
                      env={"torch": torch, "pkg_version": pkg_version})
    return mod.init_custom_process_group


def flattened_tensor_bucket():
    """SGLang's ``FlattenedTensorBucket`` (receive side of ``load_format="flattened_bucket"``)."""
    return module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
