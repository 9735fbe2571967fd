"""One reward worker process and the parent's handle on it.

Workers are plain ``python -m megatron_areal.reward.worker`` processes talking over a socket pair
(not ``multiprocessing`` spawn, which would re-run the caller's main script in every worker). The
parent first sends its ``sys.path`` and the pickled verifier registry; the worker answers
``("ready",)`` once its verifiers are imported, then answers each ``(task, response_text,
answer)`` with ``(status, reward, detail)``; ``None`` asks it to exit. The parent times each
request from the moment it is sent; a worker that does not answer in time, or dies, is killed
and the caller starts a new one.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from megatron_areal.reward.registry import Verdict, VerifierRegistry

logger = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "error"]


@dataclass(frozen=True)
class RewardResult:
    reward: float
    status: Status
    detail: str = ""
    elapsed_s: float = 0.0


def _evaluate(registry: VerifierRegistry, task: str, response_text: str, answer: Any) -> tuple[Status, float, str]:
    try:
        out = registry.get(task)(response_text, answer)
        reward, detail = (out.reward, out.detail) if isinstance(out, Verdict) else (out, "")
        reward = float(reward)
        if not math.isfinite(reward):
            return "error", 0.0, f"verifier returned {reward}"
        return "ok", reward, detail
    except Exception as e:  # a verifier bug or a malformed answer scores 0, never kills the worker
        return "error", 0.0, f"{type(e).__name__}: {e}"


def _exit_with_parent(parent: int) -> None:
    """A worker stuck in a verifier would outlive a killed service; leave when the parent is gone."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def serve(conn: Connection, parent: int) -> None:
    _exit_with_parent(parent)
    path, blob = conn.recv()
    sys.path[:] = path  # so verifiers pickled by reference (e.g. from a test module) import here
    registry: VerifierRegistry = pickle.loads(blob)
    conn.send(("ready",))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the service is gone
            return
        if request is None:
            return
        conn.send(_evaluate(registry, *request))


class WorkerError(RuntimeError):
    pass


class Worker:
    def __init__(self, registry: VerifierRegistry, name: str) -> None:
        self.name = name
        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_areal.reward.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((list(sys.path), pickle.dumps(registry)))

    def wait_ready(self, timeout_s: float) -> None:
        try:
            if self._conn.poll(timeout_s) and self._conn.recv() == ("ready",):
                return
        except (EOFError, OSError):
            pass
        self.kill()
        raise WorkerError(f"reward worker {self.name} did not start within {timeout_s:.0f}s "
                          f"(exit code {self.process.returncode}); see its stderr above")

    def run(self, request: tuple[str, str, Any], timeout_s: float) -> RewardResult:
        """Score one request; after a 'timeout' or a crash this worker is dead."""
        start = time.monotonic()
        try:
            self._conn.send(request)
            if self._conn.poll(timeout_s):
                status, reward, detail = self._conn.recv()
                return RewardResult(reward, status, detail, time.monotonic() - start)
        except (EOFError, OSError) as e:
            self.kill()
            return RewardResult(0.0, "error", f"reward worker died (exit code {self.process.returncode}): {e!r}",
                                time.monotonic() - start)
        self.kill()
        return RewardResult(0.0, "timeout", f"no answer within {timeout_s}s; worker killed",
                            time.monotonic() - start)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self._conn.closed

    def stop(self, timeout_s: float = 2.0) -> None:
        try:
            self._conn.send(None)
            self.process.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._conn.close()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
