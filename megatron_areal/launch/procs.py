"""Child processes that are stopped together: no orphan and no bound port outlives the launcher.

Each child starts in its own session (its own process group), with its output appended to
``<log_dir>/<name>.log``. Stopping sends SIGTERM to every child's group and to every descendant
found under it (torchrun puts each worker in a session of its own, so killing torchrun's group
alone would orphan the workers), waits ``grace_s``, then SIGKILLs whatever is left.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

logger = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


class ProcessSet:
    """The processes one launcher started; ``stop_all`` ends every one of them and their children."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.children: list[Child] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:  # append: a requeued job keeps the earlier attempt's log
            log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            log.flush()
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        child = Child(name, popen, log_path)
        self.children.append(child)
        logger.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return child

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.returncode() is not None]

    def wait_any(self, names: set[str] | None = None, poll_s: float = 0.2) -> Child:
        """Block until one child (of ``names``, or any) exits; return it."""
        while True:
            for c in self.children:
                if (names is None or c.name in names) and c.returncode() is not None:
                    return c
            time.sleep(poll_s)

    def _tree(self) -> list[psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        for c in self.children:
            try:
                root = psutil.Process(c.pid)
                for p in [root, *root.children(recursive=True)]:
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                continue
        return list(procs.values())

    def stop_all(self) -> None:
        """SIGTERM every child's group and descendants, SIGKILL after the grace period, reap all."""
        tree = self._tree()
        for c in self.children:
            if c.returncode() is None:
                _signal_group(c.pid, signal.SIGTERM)
        for p in tree:
            _signal_proc(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=self.grace_s)
        for c in self.children:
            _signal_group(c.pid, signal.SIGKILL)  # also catches grandchildren started during the grace
        for p in alive:
            logger.warning("pid %d did not stop within %.0f s of SIGTERM; killing it", p.pid, self.grace_s)
            _signal_proc(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        for c in self.children:
            try:
                c.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) survived SIGKILL", c.name, c.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_proc(p: psutil.Process, sig: signal.Signals) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


class Stopped(Exception):
    """SIGTERM or SIGINT arrived; ``code`` is the conventional exit status (128 + signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


def _raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextmanager
def supervised(procs: ProcessSet) -> Iterator[ProcessSet]:
    """Turn SIGTERM/SIGINT into ``Stopped`` and stop every child on the way out, whatever happened.
    Signals are ignored while stopping, so a second Ctrl-C cannot interrupt the cleanup."""
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, _raise_stopped) for s in stops}
    try:
        yield procs
    finally:
        for s in stops:
            signal.signal(s, signal.SIG_IGN)
        procs.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
