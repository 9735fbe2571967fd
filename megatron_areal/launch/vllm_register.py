"""The watcher beside a vLLM server (``launch/vllm.exec_server`` starts it):
``python -m megatron_areal.launch.vllm_register DIR ID URL PID MODEL``.

- Registers the server in the run directory ``DIR`` under ``ID`` once its ``/health`` answers (vLLM has no
  registration of its own) and, in a launched run, it proves it holds the run's nonce (``util/run_identity.py``):
  a port that answers may be another job's server, when this one failed to bind it; an empty ``DIR``
  registers nothing.
- Reaps what the server leaves behind: vLLM computes in child processes (engine core, workers) that
  outlive an API server killed with SIGKILL and hold gigabytes; when ``PID`` is gone, the children it
  had are killed, so a restarted server does not run beside its predecessor's engine.

Exits once the server's process is gone (with 1 when it never became healthy).
"""
from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request

import psutil

from megatron_areal.server.cli import write_registration
from megatron_areal.util.run_identity import identity_problem, run_nonce

POLL_S = 1.0


def healthy(url: str) -> bool:
    """``/health`` answers 200, from the server of this run (when the watcher has the run's nonce)."""
    nonce = run_nonce()
    if nonce and identity_problem(url, nonce) is not None:
        return False
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by the launcher, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def reap(orphans: list[psutil.Process]) -> None:
    """SIGKILL the server's former children that still run (``psutil`` checks each is the same process)."""
    for proc in orphans:
        try:
            proc.kill()
        except psutil.Error:
            pass


def main(argv: list[str]) -> int:
    directory, server_id, url, pid_text, model = argv
    pid = int(pid_text)
    # Leave the server's process tree: a launcher stopping the server stops its whole tree, and the
    # engine processes that outlive the server are exactly what this watcher is there to reap.
    if os.fork() > 0:
        os._exit(0)
    registered, known = False, []
    while running(pid):
        known = children(pid) or known
        if not registered and healthy(url):
            if directory:
                write_registration(directory, server_id, {"url": url, "pid": pid, "model": model})
            registered = True
        time.sleep(POLL_S)
    reap(known)
    return 0 if registered else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
