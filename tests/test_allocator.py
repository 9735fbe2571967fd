"""CPU trainer ranks get mimalloc preloaded (``cluster.cpu_allocator``), and it really serves malloc."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from megatron_areal.configbase import ConfigError
from megatron_areal.launch import allocator
from megatron_areal.launch.commands import role_env

# a declared dependency where a wheel exists (setup.py); elsewhere auto falls back to glibc
HAS_WHEEL = sys.platform == "linux" and platform.machine() == "x86_64"

PROBE = """
import ctypes
import torch
maps = open("/proc/self/maps").read()
process = ctypes.CDLL(None)
x = torch.randn(1 << 20) @ torch.randn(1 << 20)  # tensors of 4 MiB through malloc
print("libmimalloc" in maps, hasattr(process, "mi_version"), float(x) == float(x))
"""


def _probe(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()


@pytest.mark.skipif(not HAS_WHEEL, reason="cmeel-mimalloc has no wheel for this platform")
def test_cpu_trainer_env_preloads_mimalloc_and_it_serves_malloc():
    library = allocator.mimalloc_library()
    assert library is not None, "cmeel-mimalloc is a dependency on x86-64 Linux (setup.py)"
    env = role_env((), True, ("127.0.0.1", 29500), threads=1, allocator="auto")
    assert env["LD_PRELOAD"].split(":")[0] == str(library)
    assert _probe(env) == ["True", "True", "True"]
    plain = role_env((), True, ("127.0.0.1", 29500), threads=1, allocator="glibc")
    assert "libmimalloc" not in plain.get("LD_PRELOAD", "")
    assert _probe(plain)[:2] == ["False", "False"]


def test_gpu_roles_keep_their_allocator():
    assert "libmimalloc" not in role_env((0,), False, allocator="mimalloc").get("LD_PRELOAD", "")


def test_existing_preloads_are_kept(monkeypatch, tmp_path):
    fake = tmp_path / "libmimalloc.so"
    fake.write_bytes(b"")
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: fake)
    env = allocator.with_allocator({"LD_PRELOAD": "/opt/libother.so:" + str(fake)}, "auto")
    assert env["LD_PRELOAD"] == f"{fake}:/opt/libother.so"


def test_required_but_missing_mimalloc_is_a_config_error(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    env = {"PATH": os.environ.get("PATH", "")}
    assert allocator.with_allocator(env, "auto") == env
    with pytest.raises(ConfigError, match="cluster.cpu_allocator: mimalloc: libmimalloc.so not found"):
        allocator.with_allocator(env, "mimalloc")
