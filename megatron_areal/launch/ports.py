"""Ports a run on this machine will bind: claimed against other runs, checked against every other process.

A port that is free when a run plans may be taken before the run binds it: the trainer's rendezvous is
bound only after every server has registered, seconds to minutes later. Two runs started together plan the
same free ports. So each launcher *claims* the ports it plans - an exclusive ``flock`` on a file per port in
a directory all runs of the machine share, held until the launcher exits (the kernel drops it even when
the launcher is killed) - and a run moves off any port another run claims or any process listens on.
A process that is no run of ours can still take a port between the check and the bind; then the server
fails to bind (and the registry admits no impostor: ``util/run_identity.py``) or the trainer's rendezvous fails,
and the launcher names the port (``launch/local.py``).
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
import tempfile
from pathlib import Path

import psutil

from megatron_areal.run.errors import LaunchError
from megatron_areal.util.netutil import free_port, port_free

logger = logging.getLogger(__name__)


def claims_dir() -> Path:
    """``$TMPDIR/megatron-areal-ports``, shared by every run on the machine (sticky and world-writable, like
    /tmp); a per-user folder instead where that one belongs to another user who did not open it to all."""
    tmp = Path(tempfile.gettempdir())
    shared = tmp / "megatron-areal-ports"
    try:
        shared.mkdir(mode=0o1777, exist_ok=True)
        info = shared.lstat()
        if info.st_uid == os.getuid():
            shared.chmod(0o1777)
            return shared
        if info.st_uid == 0 and stat.S_ISDIR(info.st_mode) and info.st_mode & 0o1777 == 0o1777:
            return shared
    except OSError:
        pass
    own = tmp / f"megatron-areal-ports-{os.getuid()}"
    own.mkdir(mode=0o700, exist_ok=True)
    return own


class PortClaims:
    """The ports this launcher claimed; ``release()`` (or the process's exit) gives them back."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or claims_dir()
        self._held: dict[int, int] = {}  # port -> fd of its locked file

    def claim(self, port: int) -> bool:
        """Claim ``port`` for this run: False when another run holds it (or its file cannot be opened)."""
        if port in self._held:
            return True
        path = self.directory / f"{port}.lock"
        try:
            # read-only is enough for flock; never through a link another user planted
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[port] = fd
        return True

    def usable(self, host: str, port: int) -> bool:
        """Claim ``port`` if no other run claimed it and nothing listens on it; False otherwise."""
        if not self.claim(port):
            return False
        if port_free(host, port):
            return True
        self.release(port)
        return False

    def pick(self, host: str, avoid: set[int], tries: int = 200) -> int:
        """A port free now, claimed for this run, and not in ``avoid``."""
        for _ in range(tries):
            port = free_port(host, avoid)
            if self.usable(host, port):
                return port
            avoid = {*avoid, port}
        raise LaunchError(f"no free port on {host} that could be claimed in {self.directory} after {tries} tries")

    def release(self, port: int | None = None) -> None:
        """Give back ``port`` (default: every port)."""
        for p in [port] if port is not None else list(self._held):
            fd = self._held.pop(p, None)
            if fd is not None:
                os.close(fd)

    @property
    def held(self) -> set[int]:
        return set(self._held)

    def __del__(self) -> None:
        self.release()


def listener_of(port: int) -> str:
    """Who listens on ``port`` on this machine ("pid N, name"), as far as this user may see; "" if unknown."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return ""
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            try:
                return f"pid {c.pid}, {psutil.Process(c.pid).name()}"
            except psutil.Error:
                return f"pid {c.pid}"
    return ""


def taken_by(port: int) -> str:
    """" (pid N, name)" when the listener of ``port`` is known, else ""."""
    who = listener_of(port)
    return f" ({who})" if who else ""
