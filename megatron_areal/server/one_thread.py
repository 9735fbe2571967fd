"""Tensor work off the model runner's thread runs on one thread, so a CPU server has one OpenMP team.

libgomp (PyTorch's OpenMP) gives every thread that starts a parallel region a team of its own worker
threads and keeps it until that thread exits. Once a process holds more OpenMP threads than it has
CPUs, libgomp stops spinning at barriers (100 spins instead of about 300,000) and sleeps in the
kernel, so each of a decode step's several hundred small parallel regions pays a wake-up. The
engine used to be built (random init, weight load, KV allocation) on the server's loader thread
and stepped on its runner thread: two teams, and on a 2-CPU machine a 2-thread server ran no faster
than a 1-thread one. Built on one thread (no team), the runner's team is the only one.

Measured on a 2-core AMD EPYC, SmolLM2-135M fp32, 64 samples of long-tailed length (bench/serve.py's
workload), 32 decoded together, 2 threads: 48.0 s built with 2 threads, 37.9 and 39.5 s built with one;
the same steps on the main thread with no second team 42.6 s, and with ``OMP_WAIT_POLICY=PASSIVE``
(always sleeping) 63.6 s.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the enclosed tensor work on this thread alone (no OpenMP team), then restore the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
