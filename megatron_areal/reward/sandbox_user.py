"""A user id of its own for each sandbox that runs at the same time, when the service runs as root.

The sandbox's process limit is ``RLIMIT_NPROC``, which the kernel checks against the number of
processes of the *user*, not of the sandbox. Were every sandbox to run as one shared user
(``nobody``), one answer's fork bomb would fill that count and another answer's first ``fork``
would fail with ``BlockingIOError``. So each sandbox claims a uid that no account and no running
process has, from a fixed range, for as long as it runs: its limit then counts its own processes
only, whatever the others do.

A claim is an exclusive ``flock`` on a lock file named after the uid, in a directory only root
may write (``LOCK_DIR``), so that claims hold across the threads and the worker processes of one
service and across services on one machine that share that directory; the kernel drops the lock
when its holder closes the file or dies, and a uid is skipped while any process still runs as it.

Without root the sandbox runs as the service's own user, whose count includes every process of
that user on the host (see SECURITY.md): nothing here applies.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

# uids 1,879,048,192 .. +4,095: far above the ranges distributions give accounts (below 60,000)
# and the ranges of container runtimes' subordinate ids (100,000 .. a few million).
FIRST_UID = 0x7000_0000
SLOTS = 4096
# A fixed place, not $TMPDIR: services with different temporary directories on one machine must
# see each other's claims.
LOCK_DIR = Path("/run/lock" if os.path.isdir("/run/lock") else "/tmp", "megatron-areal-sandbox-uids")


class NoSandboxUser(RuntimeError):
    """Every uid of the range is in use, or the lock directory is not root's own."""


@dataclass
class SandboxUser:
    """A claimed uid; ``release`` (or the claimant's death) frees it."""

    uid: int
    _lock_fd: int

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _lock_dir() -> Path:
    """The lock directory, made by root with mode 0700; refused if anyone else could have made it."""
    try:
        LOCK_DIR.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise NoSandboxUser(f"{LOCK_DIR} must be a directory owned by root and writable by root only")
    return LOCK_DIR


def _has_processes(uid: int) -> bool:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    return True
            except OSError:  # the process exited while we looked
                pass
    return False


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def claim_user() -> SandboxUser:
    """A uid of the range that no other sandbox holds, no account names and no process runs as."""
    directory = _lock_dir()
    for uid in range(FIRST_UID, FIRST_UID + SLOTS):
        fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _is_account(uid) or _has_processes(uid):
            os.close(fd)
            continue
        return SandboxUser(uid, fd)
    raise NoSandboxUser(f"all {SLOTS} sandbox uids from {FIRST_UID} are in use")
