"""What the trainer does to hold less memory changes no number of the training.

- ``model.recompute_activations``: one decoupled-PPO step (bf16 weights, distributed optimizer,
  stochastic rounding, several micro-batches) with activation recomputation gives the same weights,
  bit for bit, as without;
- ``parallel.mb_token_multiple``: micro-batches padded to a multiple of 64 tokens give the same
  weights after a step, and are padded;
- ``megatron_areal/util/heap.py``: heap memory freed by tensors goes back to the system (the kernel's VmRSS).
(The checkpoint's optimizer state saved as views: tests/test_checkpoint.py.)
"""
from __future__ import annotations

import os

import pytest
import torch
from test_actor_parallel import ARCHS, Group, _trajectories

from megatron_areal.util.compute_dtype import BF16_ANYWAY_ENV

pytestmark = pytest.mark.timeout(300)


def case_step(recompute: bool, multiple: int = 1) -> list[torch.Tensor]:
    """The bf16 weights after one PPO step of a tiny Llama, with or without recomputation, its
    micro-batches padded to a multiple of ``multiple`` tokens."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig

    os.environ[BF16_ANYWAY_ENV] = "1"  # the bf16 path itself, also on CPUs without native bf16 matmuls
    groups = init_parallel(1, 1, seed=3, backend="gloo")
    actor = Actor(ARCHS["llama"], ModelConfig(max_seq_len=40, dtype="bfloat16", recompute_activations=recompute),
                  ParallelConfig(tp=1, pp=1, max_tokens_per_mb=48, mb_token_multiple=multiple),
                  OptimizerConfig(lr=1e-3, bf16_rounding="stochastic"), PPOConfig(), groups, seed=3, total_steps=2)
    assert actor.model[0].config.recompute_granularity == ("full" if recompute else None)
    planned = actor._plan([t.input_ids for t in _trajectories()], 1)
    assert all(mb.n_tokens % multiple == 0 and mb.n_tokens - mb.n_real_tokens < multiple for mb in planned)
    stats = actor.ppo_update(_trajectories(), 0.7)
    assert stats["n_microbatches"] > 1
    weights = [p.detach().clone() for c in actor.model for p in c.parameters()]
    teardown_parallel()
    return weights


@pytest.fixture(scope="module")
def group():
    g = Group(1)
    yield g
    g.close()


def _weights_after_step(group: Group, **kwargs) -> list[torch.Tensor]:
    group.submit(case_step, **kwargs)
    return group.collect()[0]


@pytest.fixture(scope="module")
def plain(group) -> list[torch.Tensor]:
    """The weights after a step without recomputation or padding, which both tests compare with."""
    weights = _weights_after_step(group, recompute=False)
    assert weights[0].dtype == torch.bfloat16
    return weights


def test_recomputation_changes_no_weight(group, plain):
    recomputed = _weights_after_step(group, recompute=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


def test_padded_microbatches_change_no_weight(group, plain):
    padded = _weights_after_step(group, recompute=False, multiple=64)
    assert all(torch.equal(a, b) for a, b in zip(plain, padded, strict=True))


RELEASE_PROBE = """
import torch
from megatron_areal.util.heap import release_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mib()
blocks = [torch.ones(16384) for _ in range(8000)]  # 64 KiB each, below glibc's mmap threshold: 500 MiB of heap
keep = blocks[-1]  # the top of the heap stays in use, so glibc cannot shrink the heap from its end
del blocks
held = rss_mib()
assert release_freed_memory()
print(base, held, rss_mib())
"""


def test_freed_heap_memory_goes_back_to_the_system():
    """A process that freed 500 MiB of small tensors below a live one keeps them resident; after
    ``release_freed_memory`` its resident set (the kernel's VmRSS) has dropped by most of them."""
    import os
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    base, held, released = map(float, out.stdout.split())
    assert held - base > 400, (base, held)  # freeing alone gave nothing back
    assert held - released > 350, (base, held, released)
