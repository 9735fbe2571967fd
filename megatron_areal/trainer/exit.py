"""A trainer rank ends when its main work ends: a failure is said once, and nothing it started keeps it alive.

Python exits only after every non-daemon thread has finished (and joins the workers of every
``concurrent.futures`` executor). A rank whose ``init_process_group`` failed while rank 0's duties were
already at work (a held-out evaluation of agent episodes, the rollout loop) printed its traceback and then
waited on those threads for minutes, and the launcher waited on it. So: after a failure the rank logs the
reason and the threads it leaves, and exits at once (``os._exit``); after success it gives its threads
``LINGER_S`` to finish. While the main thread runs, a daemon thread touches the rank's heartbeat file, by
which the launcher tells a stuck rank from a working one (``launch/local.py``).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # how often a live rank touches its heartbeat file
LINGER_S = 60.0  # how long a rank that succeeded waits for its own threads before it exits anyway
_PORT_IN_USE = ("EADDRINUSE", "address already in use")


def start_heartbeat(path: Path, interval_s: float = HEARTBEAT_S) -> threading.Thread:
    """Touch ``path`` every ``interval_s`` while the main thread is alive (a daemon: it never holds the exit)."""
    main = threading.main_thread()

    def beat() -> None:
        while main.is_alive():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            except OSError as e:  # the run directory went away: the launcher will say so
                logger.debug("heartbeat %s: %s", path, e)
            time.sleep(interval_s)

    thread = threading.Thread(target=beat, name="trainer-heartbeat", daemon=True)
    thread.start()
    return thread


def port_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failure to listen on a port another process holds."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(word in str(exc) for word in _PORT_IN_USE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def lingering_threads() -> list[threading.Thread]:
    """Threads other than the main one that would keep the interpreter from exiting."""
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def _exit_now(code: int) -> None:
    logging.shutdown()  # flush what was logged
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(main: Callable[[], int]) -> int:
    """Run ``main``; on an exception log it and end the process at once with code 1, whatever threads run."""
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the main work ends the rank
        logger.exception("trainer failed: %s", e)
        if port_in_use(e):
            addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
            logger.error("the trainer's rendezvous port %s:%s (cluster.master_port) is taken by another process",
                         addr, port)
        left = lingering_threads()
        if left:
            logger.error("exiting without waiting for %d threads: %s", len(left), ", ".join(t.name for t in left))
        _exit_now(1)
        raise  # not reached
    deadline = time.monotonic() + LINGER_S
    for t in lingering_threads():
        t.join(max(0.0, deadline - time.monotonic()))
    left = lingering_threads()
    if left:
        logger.error("%d threads still run %.0f s after the trainer finished (%s); exiting without them", len(left),
                     LINGER_S, ", ".join(t.name for t in left))
        _exit_now(code)
    return code
