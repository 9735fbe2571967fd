"""The ``gpu`` extra resolves to one world: one torch, one CUDA major, one NCCL, TE in megatron-core's range.

The pinned packages' own metadata is the reference: each pin's ``Requires-Dist`` is read from its
wheel on PyPI (the METADATA member only, through HTTP range requests on the wheel's zip directory:
a few hundred kilobytes, never a CUDA wheel), or from the installed distribution when it is the
pinned version. Every requirement a pinned package places on another pinned package, or on this
project's own dependencies, must hold for the pins. Without PyPI the test fails, naming the URL.
"""
from __future__ import annotations

import ast
import io
import json
import re
import time
import urllib.error
import urllib.request
import zipfile
from email.message import Message
from email.parser import Parser
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SIMPLE = "https://pypi.org/simple/{}/"
# The cluster world the extra is for: Linux x86_64, CPython 3.11.
ENV = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
CUDA_SUFFIX = re.compile(r"[-_]cu(\d+)$")


class _PinFilled(ast.NodeTransformer):
    """setup.py's f-strings over the one megatron-core pin (``MEGATRON_CORE_VERSION``) as plain strings."""

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.Constant:
        from megatron_areal.patches.version import MEGATRON_CORE_VERSION

        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue) and getattr(value.value, "id", "") == "MEGATRON_CORE_VERSION":
                parts.append(MEGATRON_CORE_VERSION)
            else:
                raise ValueError(f"setup.py line {node.lineno}: an f-string over something other than the pin")
        return ast.Constant("".join(parts))


def setup_requirements() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    """install_requires and extras_require of setup.py, read without running it."""
    tree = _PinFilled().visit(ast.parse((ROOT / "setup.py").read_text()))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in kw["extras_require"].items()}
    return [Requirement(r) for r in kw["install_requires"]], extras


def pinned_version(req: Requirement) -> Version:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"gpu extra: {req} is not pinned with =="
    return Version(specs[0].version)


def _get(url: str, headers: dict[str, str] | None = None, attempts: int = 3) -> bytes:
    for i in range(attempts):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as r:
                return r.read()
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if i == attempts - 1:
                pytest.fail(f"cannot read {url} ({e}): this test checks the gpu extra against PyPI's metadata "
                            "and needs PyPI")
            time.sleep(2 * (i + 1))
    raise AssertionError("unreachable")


class RangeReader(io.RawIOBase):
    """A remote file read by HTTP range requests, enough for ``zipfile`` to find one member."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        end = min(self.pos + len(buf), self.size)
        if end <= self.pos:
            return 0
        data = _get(self.url, {"Range": f"bytes={self.pos}-{end - 1}"})
        assert len(data) == end - self.pos, f"{self.url}: the server ignored the range request"
        buf[:len(data)] = data
        self.pos = end
        return len(data)


def _wheel_fits(filename: str) -> bool:
    tags: frozenset[Tag] = parse_wheel_filename(filename)[3]
    return any(t.interpreter in ("cp311", "py3", "py311") and t.abi in ("cp311", "abi3", "none")
               and (t.platform == "any" or ("linux" in t.platform and t.platform.endswith("x86_64"))) for t in tags)


@cache
def wheel_metadata(name: str, version: Version) -> Message:
    """METADATA of ``name==version``: installed if that version is installed here, else from PyPI."""
    try:
        if Version(metadata.version(name)) == version and metadata.metadata(name).get_all("Requires-Dist") is not None:
            return metadata.metadata(name)  # type: ignore[return-value]
    except metadata.PackageNotFoundError:
        pass
    index = json.loads(_get(SIMPLE.format(canonicalize_name(name)), {"Accept": "application/vnd.pypi.simple.v1+json"}))
    wheels = [f for f in index["files"] if f["filename"].endswith(".whl") and not f.get("yanked")
              and parse_wheel_filename(f["filename"])[1] == version and _wheel_fits(f["filename"])]
    assert wheels, f"PyPI has no Linux x86_64 CPython 3.11 wheel of {name}=={version}"
    wheel = min(wheels, key=lambda f: f["size"])
    with zipfile.ZipFile(io.BufferedReader(RangeReader(wheel["url"], wheel["size"]), 1 << 18)) as z:
        member = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return Parser().parsestr(z.read(member).decode())


def requirements_of(req: Requirement, extra_names: tuple[str, ...] = ()) -> list[Requirement]:
    """What the pinned ``req`` (with its requested extras) requires on the cluster platform."""
    extras = ("",) + tuple(req.extras) + extra_names
    out = []
    for line in wheel_metadata(req.name, pinned_version(req)).get_all("Requires-Dist") or []:
        dep = Requirement(line)
        if dep.marker is None or any(dep.marker.evaluate({**ENV, "extra": e}) for e in extras):
            out.append(dep)
    return out


@pytest.fixture(scope="module")
def gpu() -> dict[str, Requirement]:
    _, extras = setup_requirements()
    pins = {canonicalize_name(r.name): r for r in extras["gpu"]}
    for r in pins.values():
        pinned_version(r)
    return pins


def test_gpu_extra_pins_sglang_and_exactly_what_it_pins(gpu: dict[str, Requirement]) -> None:
    """sglang 0.5.23 is what the protocol notes were read from; its exact pins are part of the world."""
    assert pinned_version(gpu["sglang"]) == Version("0.5.23")
    exact = {canonicalize_name(d.name): d for d in requirements_of(gpu["sglang"]) if str(d.specifier).startswith("==")}
    for name in ("torch", "transformers"):
        assert name in gpu, f"the gpu extra must pin {name} (sglang pins {exact[name]})"
        assert pinned_version(gpu[name]) in exact[name].specifier, f"sglang needs {exact[name]}, extra pins {gpu[name]}"


def test_every_pin_satisfies_every_other_pins_requirements(gpu: dict[str, Requirement]) -> None:
    """Each pinned package's requirements on the others (and megatron-core's TE range) hold."""
    install, _ = setup_requirements()
    world = {**gpu, **{canonicalize_name(r.name): r for r in install if str(r.specifier).startswith("==")}}
    problems = []
    for name, req in world.items():
        # megatron-core declares the Transformer Engine it supports in its "dev" extra
        extra = ("dev",) if name == "megatron-core" else ()
        for dep in requirements_of(req, extra):
            other = world.get(canonicalize_name(dep.name))
            if other is not None and not dep.specifier.contains(pinned_version(other), prereleases=True):
                problems.append(f"{req} requires {dep}, the extra pins {other}")
    for dep in install:  # this project's own dependencies hold in the GPU world too
        other = gpu.get(canonicalize_name(dep.name))
        if other is not None and not dep.specifier.contains(pinned_version(other), prereleases=True):
            problems.append(f"megatron-areal requires {dep}, the gpu extra pins {other}")
    assert not problems, "\n".join(problems)


def test_transformer_engine_is_in_megatron_cores_range(gpu: dict[str, Requirement]) -> None:
    install, _ = setup_requirements()
    mcore = next(r for r in install if canonicalize_name(r.name) == "megatron-core")
    te_range = [d for d in requirements_of(mcore, ("dev",)) if canonicalize_name(d.name) == "transformer-engine"]
    assert te_range, f"{mcore} declares no transformer-engine range"
    assert "transformer-engine" in gpu, "the gpu extra must pin transformer-engine"
    for d in te_range:
        assert d.specifier.contains(pinned_version(gpu["transformer-engine"]), prereleases=True), \
            f"{mcore} needs {d}; the gpu extra pins {gpu['transformer-engine']}"


def test_one_torch_one_cuda_major_one_nccl(gpu: dict[str, Requirement]) -> None:
    """Every CUDA-suffixed package of the world (pins and what they require) has torch's CUDA major."""
    torch_deps = requirements_of(gpu["torch"])
    nccl = [d for d in torch_deps if canonicalize_name(d.name).startswith("nvidia-nccl-")]
    assert len(nccl) == 1, f"torch {pinned_version(gpu['torch'])} names no single NCCL: {nccl}"
    major = CUDA_SUFFIX.search(nccl[0].name).group(1)  # type: ignore[union-attr]
    names = {canonicalize_name(r.name): r for r in gpu.values()}
    for req in gpu.values():
        for dep in requirements_of(req):
            names.setdefault(canonicalize_name(dep.name), dep)
    majors = {n: m.group(1) for n in names if (m := CUDA_SUFFIX.search(n))}
    wrong = {n: m for n, m in majors.items() if m != major}
    assert not wrong, f"torch is built for CUDA {major}; these are for another CUDA: {wrong}"
    pinned_nccl = [r for n, r in gpu.items() if n.startswith("nvidia-nccl-")]
    assert len(pinned_nccl) == 1 and pinned_nccl[0].name == nccl[0].name and \
        pinned_version(pinned_nccl[0]) in nccl[0].specifier, f"the extra's NCCL {pinned_nccl} is not torch's {nccl[0]}"
    te = gpu["transformer-engine"]
    assert te.extras == {f"core_cu{major}"} or te.extras == {f"core-cu{major}"}, \
        f"{te}: the Transformer Engine core library must be the CUDA {major} build (extra core_cu{major})"


def test_readme_states_the_pinned_set(gpu: dict[str, Requirement]) -> None:
    """The README's GPU section names each pin, and builds TE's torch extension against that torch."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## GPU clusters", 1)[1].split("\n## ", 1)[0]
    for req in gpu.values():
        assert f"{req.name}=={pinned_version(req)}" in section, f"README's GPU section does not state {req}"
    te_version = pinned_version(gpu["transformer-engine"])
    assert re.search(rf"--no-build-isolation[^\n]*transformer-engine-torch=={re.escape(str(te_version))}", section), \
        "README must build transformer-engine-torch at the pinned TE version against the installed torch"
