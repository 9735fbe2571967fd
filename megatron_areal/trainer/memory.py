"""Make the trainer process give freed tensor memory back to the system (glibc ``mallopt``).

PyTorch's CPU tensors come from ``malloc``. glibc serves requests below its mmap threshold from
heaps that it returns to the system only from their top, and the threshold starts at 128 KiB but
rises (up to 32 MiB) each time a larger mapped block is freed. After the first micro-batch, the
activations of a training step (1 to 6 MiB tensors for 1024 tokens of SmolLM2-135M) therefore
come from the heap, and the resident set keeps, fragmented, what the busiest step ever used.
Measured with bench/trainer_memory.py (the main job's shapes, SmolLM2-135M, one rank): resident
between steps 4.0 -> 4.4 GiB and growing with glibc's defaults, 2.8 -> 2.9 GiB with a fixed 64 KiB
threshold and two arenas (what is really held: weights, fp32 master, fp32 gradients, Adam moments,
libraries); peak of a training step 4.5 -> 4.9 GiB against 4.0 GiB.

A fixed threshold costs one mapping and its page faults per large tensor; the steps of that bench
took no longer (36 s against 42-52 s for the forward and backward, on a shared machine).
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD = 64 * 1024  # bytes: tensors at least this big get a mapping of their own
ARENA_MAX = 2  # arenas of the main thread and the helper threads (gloo, rollouts, rewards)


def return_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, arena_max: int = ARENA_MAX) -> bool:
    """Serve allocations of ``mmap_threshold`` bytes or more from mappings of their own, which go back to
    the system when freed (fixing the threshold also stops glibc raising it), and cap the arenas at
    ``arena_max``. Call once, early in the process. Returns False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_ARENA_MAX, arena_max))
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("mallopt unavailable (not glibc): freed tensor memory may stay in the trainer's resident set")
    return ok
