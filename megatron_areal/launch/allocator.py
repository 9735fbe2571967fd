"""The C allocator of a CPU trainer: mimalloc, preloaded, where it is installed; glibc's otherwise.

PyTorch's CPU tensors come from ``malloc``. With glibc's, a training step's activations of many
sizes leave its heaps fragmented: measured with bench/trainer_memory.py (SmolLM2-135M, the main
job's shapes, quiet 2-core machine), the step's resident peak was 4.29 GiB while ``malloc`` never had
more than 3.26 GiB handed out. With mimalloc (``cmeel-mimalloc``, a dependency on x86-64 Linux)
preloaded into the same bench: peak 3.76 GiB, and steps of 23-27 s instead of 31-39 s.

``cluster.cpu_allocator``: ``auto`` preloads mimalloc where its library is installed, ``mimalloc``
requires it, ``glibc`` leaves ``malloc`` alone. GPU roles are never changed.
"""
from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

from megatron_areal.configbase import ConfigError

_LIBRARY = Path("cmeel.prefix") / "lib" / "libmimalloc.so"  # where the cmeel-mimalloc wheel puts it


def mimalloc_library() -> Path | None:
    """The installed ``libmimalloc.so`` (from the ``cmeel-mimalloc`` wheel), or None."""
    roots = [sysconfig.get_paths()["purelib"], site.getusersitepackages(), *sys.path]
    for root in roots:
        candidate = Path(root) / _LIBRARY
        if candidate.is_file():
            return candidate.resolve()
    return None


def with_allocator(env: dict[str, str], allocator: str) -> dict[str, str]:
    """``env`` with mimalloc added to ``LD_PRELOAD`` as ``allocator`` asks (auto, mimalloc, glibc)."""
    if allocator == "glibc":
        return env
    library = mimalloc_library()
    if library is None:
        if allocator == "mimalloc":
            raise ConfigError("cluster.cpu_allocator: mimalloc: libmimalloc.so not found "
                              "(pip install cmeel-mimalloc, or set cluster.cpu_allocator: glibc)")
        return env
    preloaded = [p for p in env.get("LD_PRELOAD", "").split(":") if p and Path(p).name != library.name]
    return {**env, "LD_PRELOAD": ":".join([str(library), *preloaded])}
