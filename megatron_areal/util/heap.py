"""Give the trainer's freed tensor memory back to the system after each step (glibc ``malloc_trim``, or
mimalloc's ``mi_collect`` where the launcher preloaded it: launch/allocator.py).

PyTorch's CPU tensors come from ``malloc``. glibc serves requests below its mmap threshold from
heaps that it returns to the system only from their top, and the threshold rises (up to 32 MiB)
each time a larger mapped block is freed, so after the first micro-batch a training step's
activations come from the heap and the resident set keeps, fragmented, what the busiest step
ever used. ``malloc_trim(0)`` at a step boundary releases the free pages inside the heaps too.

Measured with bench/trainer_memory.py (the main job's shapes, SmolLM2-135M, one rank, 3 steps,
2 threads, quiet 2-core machine): glibc's defaults, 22-23 s a step, resident between steps 3.3 ->
4.1 -> 4.2 GiB and growing, peak 4.76 GiB; trimmed after each step, 22 s a step, 2.84-2.91 GiB
between steps (what is really held: weights, fp32 master, fp32 gradients, Adam moments,
libraries), peak 4.61 GiB. A fixed mmap threshold instead (``mallopt``) gave a lower peak (4.06
GiB at 64 KiB) but doubled the step time (45 s: a mapping and its page faults per tensor); at
4 MiB it was slower (37 s) and saved nothing.

mimalloc returns freed memory after a delay, but only on its own later calls: after a checkpoint save
(transient copies of weights and optimizer state) the next step ran with the save's freed memory still
resident, its peak 0.25 GiB above the others (bench/trainer_memory.py, precision-aware optimizer);
``mi_collect(true)`` after the save gives it back.
"""
from __future__ import annotations

import ctypes
import functools


def _release_function():
    """mimalloc's ``mi_collect(force=true)`` if it is loaded in this process, else glibc's ``malloc_trim(0)``."""
    try:
        return functools.partial(ctypes.CDLL(None).mi_collect, 1)  # preloaded: in the global symbol scope
    except AttributeError:
        pass
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)  # glibc only
    except (OSError, AttributeError):
        return None


_RELEASE = _release_function()


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the system (call between steps, not inside one).
    Returns False where the allocator is neither glibc's nor mimalloc (nothing is done)."""
    if _RELEASE is None:
        return False
    _RELEASE()
    return True
