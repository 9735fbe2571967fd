"""A pool of gloo worker processes that run functions together, one torch.distributed world.

Conversion at TP x PP > 1 needs that many ranks. ``WorkerPool`` starts them once (spawned, so the
parent stays free of Megatron's process-wide CPU patch) and runs any module-level function on
every rank; tests keep one pool for a whole module and switch layouts inside it. A failure on
any rank tears the pool down (its peers would otherwise wait forever in a collective) and is
re-raised in the parent with the failing rank's traceback.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_areal.util.netutil import free_port

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A function failed on a worker rank; the message carries that rank's traceback."""


def _serve(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    # Own process group: megatron-core's checkpoint writer starts a multiprocessing Manager in
    # each rank; closing the pool kills the whole group so none of them outlives its worker.
    os.setpgrp()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything: the parent decides
            outbox.put((rank, False, traceback.format_exc()))
            break
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerPool:
    """``world`` spawned worker processes forming one torch.distributed world (gloo)."""

    def __init__(self, world: int, timeout_s: float = 1800.0) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.timeout_s = timeout_s
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, world, port, self._inboxes[r], self._outbox))
                       for r in range(world)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        if not self._procs:
            raise WorkerError("the worker pool is closed (a previous job failed)")
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.world:
            if time.monotonic() > deadline:
                self.close(force=True)
                raise WorkerError(f"{fn.__name__} did not finish within {self.timeout_s:.0f} s")
            try:
                rank, ok, value = self._outbox.get(timeout=5.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive() and r not in results}
                if dead:
                    self.close(force=True)
                    raise WorkerError(f"worker rank(s) {sorted(dead)} died (exit codes {list(dead.values())}) "
                                      f"while running {fn.__name__}") from None
                continue
            if not ok:
                self.close(force=True)
                raise WorkerError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        for inbox, proc in zip(self._inboxes[: len(self._procs)], self._procs, strict=True):
            if force:
                proc.kill()
            elif proc.is_alive():
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=5)  # idle workers exit at once; a stuck teardown is not worth waiting for
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.join(timeout=5)
        self._procs = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)
