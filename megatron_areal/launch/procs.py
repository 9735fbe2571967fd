"""Child processes that are stopped together: no orphan and no bound port outlives the launcher.

Each child starts in its own session (its own process group), with its output appended to
``<log_dir>/<name>.log``. Stopping sends SIGTERM to every child's group and to every descendant
found under it (torchrun puts each worker in a session of its own, so killing torchrun's group
alone would orphan the workers), waits ``grace_s``, then SIGKILLs whatever is left.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import BinaryIO

import psutil

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: if the launcher itself is killed outright (SIGKILL, the OOM
    killer), the kernel sends the child SIGTERM, so even then nothing it started keeps running."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def log_tail(path: str | Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log, for an error message ("(no log)" when it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def open_private_log(path: Path) -> BinaryIO:
    """Append to ``path``, readable by its owner only (0600, also when an earlier attempt made it
    with a wider mode): a server's log may hold what its program prints about its own settings
    (SGLang logs every server argument at start-up, the API key among them)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    cmd: list[str] = field(default_factory=list)  # what started it, for a restart
    env: dict[str, str] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)


class ProcessSet:
    """The processes one launcher started; ``stop_all`` ends every one of them and their children."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.children: list[Child] = []
        # A stop signal that lands while a child is being created is held until the child is on
        # the list: raising inside Popen would leave a running process nobody knows about.
        self._starting = False
        self._held_signal: int | None = None

    def on_stop_signal(self, signum: int) -> None:
        if self._starting:
            self._held_signal = signum
        else:
            raise Stopped(signum)

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        self._starting = True
        try:
            with open_private_log(log_path) as log:  # append: a requeued job keeps the earlier attempt's log
                log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
                log.flush()
                popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            child = Child(name, popen, log_path, list(cmd), env)
            self.children.append(child)
        finally:
            self._starting = False
        logger.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        if self._held_signal is not None:
            raise Stopped(self._held_signal)
        return child

    def restart(self, child: Child) -> Child:
        """Start an exited child's command again under its name (its log goes on); the new process
        takes the old one's place in the set. Whatever the old one left in its process group is
        killed first, so nothing of it holds the port the new one binds."""
        if child.returncode() is None:
            raise RuntimeError(f"{child.name} (pid {child.pid}) is still running")
        _signal_group(child.pid, signal.SIGKILL)
        new = self.start(child.name, child.cmd, child.env)
        self.children = [c for c in self.children if c is not child]
        return new

    def kill(self, child: Child) -> None:
        """SIGKILL ``child``'s process group (a stuck child: nothing of it is worth a grace period)."""
        _signal_group(child.pid, signal.SIGKILL)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.returncode() is not None]

    def first_exited(self, names: set[str] | None = None) -> Child | None:
        """A child (of ``names``, or any) that has exited, without waiting; None while all run."""
        for c in self.children:
            if (names is None or c.name in names) and c.returncode() is not None:
                return c
        return None

    def wait_any(self, names: set[str] | None = None, poll_s: float = 0.2) -> Child:
        """Block until one child (of ``names``, or any) exits; return it."""
        while (c := self.first_exited(names)) is None:
            time.sleep(poll_s)
        return c

    def _descendants(self) -> list[psutil.Process]:
        """Every process below the children (not the children: Popen reaps those, keeping their codes)."""
        procs: dict[int, psutil.Process] = {}
        for c in self.children:
            try:
                for p in psutil.Process(c.pid).children(recursive=True):
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                continue
        return list(procs.values())

    def _wait(self, others: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
        """Wait until children and ``others`` are gone or the time is up; return the living others."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [p for p in others if _alive(p)]
            if not alive and all(c.returncode() is not None for c in self.children):
                return []
            if time.monotonic() > deadline:
                return alive
            time.sleep(0.05)

    def stop_all(self) -> None:
        """SIGTERM every child's group and descendants, SIGKILL after the grace period, reap all."""
        others = self._descendants()
        for c in self.children:
            if c.returncode() is None:
                _signal_group(c.pid, signal.SIGTERM)
        for p in others:
            _signal_proc(p, signal.SIGTERM)
        alive = self._wait(others, self.grace_s)
        for c in self.children:
            if c.returncode() is None:
                logger.warning("%s (pid %d) did not stop within %.0f s of SIGTERM; killing it", c.name, c.pid,
                               self.grace_s)
            _signal_group(c.pid, signal.SIGKILL)  # also catches grandchildren started during the grace
        for p in alive:
            logger.warning("pid %d (%s) did not stop within %.0f s of SIGTERM; killing it", p.pid,
                           _name(p), self.grace_s)
            _signal_proc(p, signal.SIGKILL)
        self._wait(alive, 5)
        for c in self.children:
            try:
                c.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) survived SIGKILL", c.name, c.pid)


class ServerKeeper:
    """Restarts rollout servers that die: each at most ``max_restarts`` times, after ``backoff_s``
    doubled with every restart of the same server, with the same command (so the same port and
    URL, where the trainer re-admits it at its next weight sync). A server past its restarts is
    given up: said once, and the run goes on with the others; ``alive()`` counts those left.
    Call ``poll()`` often; it never blocks."""

    def __init__(self, procs: ProcessSet, servers: dict[str, Child], labels: dict[str, str], max_restarts: int,
                 backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.procs, self.max_restarts, self.backoff_s, self.clock = procs, max_restarts, backoff_s, clock
        self.servers = dict(servers)  # child name -> the current process
        self.labels = labels  # child name -> what to call it in messages (the plan's server id)
        self.restarts = Counter[str]()
        self.given_up: dict[str, str] = {}
        self._due: dict[str, float] = {}

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def alive(self) -> int:
        """Servers not given up (running, or waiting to be restarted)."""
        return len(self.servers) - len(self.given_up)

    def poll(self) -> None:
        now = self.clock()
        for name, child in list(self.servers.items()):
            if name in self.given_up:
                continue
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    self.servers[name] = self.procs.restart(child)
                continue
            code = child.returncode()
            if code is None:
                continue
            label, done = self.labels.get(name, name), self.restarts[name]
            if done >= self.max_restarts:
                self.given_up[name] = f"exited with code {code} after {done} restarts"
                logger.error("server %s died (code %s) and was restarted %d times already (server.max_restarts "
                             "%d): giving it up; the run goes on with the other %d servers; last lines of %s:\n%s",
                             label, code, done, self.max_restarts, self.alive(), child.log_path, child.log_tail())
                continue
            self.restarts[name] += 1
            delay = self.backoff_s * 2 ** done
            self._due[name] = now + delay
            logger.warning("server %s died (code %s); restarting it in %.1f s with the same command and port "
                           "(restart %d of %d); last lines of %s:\n%s", label, code, delay, done + 1,
                           self.max_restarts, child.log_path, child.log_tail())

    def summary(self) -> str:
        restarted = ", ".join(f"{self.labels.get(n, n)} x{k}" for n, k in sorted(self.restarts.items()))
        text = f"rollout servers: {self.total_restarts} restarts ({restarted or 'none'})"
        if self.given_up:
            text += "; given up: " + ", ".join(f"{self.labels.get(n, n)} ({why})" for n, why in self.given_up.items())
        return text


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return "gone"


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


@contextmanager
def supervised(procs: ProcessSet) -> Iterator[ProcessSet]:
    """Turn SIGTERM/SIGINT into ``Stopped`` and stop every child on the way out, whatever happened.
    Signals are ignored while stopping, so a second Ctrl-C cannot interrupt the cleanup."""
    stops = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, _frame: FrameType | None) -> None:
        procs.on_stop_signal(signum)

    previous = {s: signal.signal(s, handler) for s in stops}
    try:
        yield procs
    finally:
        for s in stops:
            signal.signal(s, signal.SIG_IGN)
        procs.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
