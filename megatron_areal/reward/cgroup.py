"""One memory cgroup per sandbox, so that its memory limit holds for the whole process tree.

``RLIMIT_AS`` bounds each process; an answer that forks ``n`` children gets ``n`` times the limit.
A cgroup bounds their sum. The service makes one cgroup per sandbox run: under cgroup v2 as a
child of its own cgroup or, when that one holds processes and so cannot enable the memory
controller for children, as a sibling under its parent; else under the cgroup v1 memory
hierarchy as a child of its own. Each needs write access there (root, or a delegated subtree
such as a systemd unit with ``Delegate=yes`` whose service runs in a leaf below it). Where none
is writable, ``find_base`` returns ``None`` and the sandbox keeps the per-process limit only
(see SECURITY.md).

The sandbox's first process joins the cgroup between fork and exec (``join``), before it drops
its privileges, so every descendant is inside from its birth.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_PREFIX = "megatron-areal-sandbox-"


@dataclass(frozen=True)
class CgroupBase:
    path: Path  # the service's own cgroup directory, under which each sandbox gets a child
    version: int  # 1 or 2


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root inside the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], tail[0], tail[2]))
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller (``""`` for cgroup v2) -> this process's path in that hierarchy."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _directory(mount_root: str, mount_point: str, path: str) -> Path:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path
    return Path(mount_point, relative.lstrip("/")) if relative != "." else Path(mount_point)


def _probe(base: Path, limit_file: str) -> bool:
    """Whether a child cgroup with ``limit_file`` can be made (and removed) under ``base``."""
    probe = base / f"{_PREFIX}probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return (probe / limit_file).exists()
    finally:
        probe.rmdir()


def _v2_base(mounts: list[tuple[str, str, str, str]], own: dict[str, str]) -> CgroupBase | None:
    """Children of this process's own cgroup (which must then enable the memory controller for them,
    refused while it holds processes, unless it is the root), else siblings of it under its parent
    (which already enables memory for its children if this cgroup has the controller)."""
    if "" not in own:
        return None
    for root, point, kind, _ in mounts:
        if kind != "cgroup2":
            continue
        mine = _directory(root, point, own[""])
        try:
            if "memory" not in (mine / "cgroup.controllers").read_text().split():
                continue
        except OSError:
            continue
        try:
            control = mine / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
            if _probe(mine, "memory.max"):
                return CgroupBase(mine, 2)
        except OSError:
            pass
        if own[""].strip("/") and _probe(mine.parent, "memory.max"):  # the hierarchy's root has no parent
            return CgroupBase(mine.parent, 2)
    return None


def _v1_base(mounts: list[tuple[str, str, str, str]], own: dict[str, str]) -> CgroupBase | None:
    if "memory" not in own:
        return None
    for root, point, kind, options in mounts:
        if kind == "cgroup" and "memory" in options.split(","):
            base = _directory(root, point, own["memory"])
            if _probe(base, "memory.limit_in_bytes"):
                return CgroupBase(base, 1)
    return None


def _remove_orphans(base: CgroupBase) -> None:
    """Remove the cgroups left by services that died in the middle of a run (their names carry the
    owner's pid); a cgroup still in use is never empty, and rmdir refuses it."""
    for child in base.path.glob(f"{_PREFIX}*-*"):
        owner = child.name[len(_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not Path("/proc", owner).exists():
            try:
                child.rmdir()
            except OSError:
                pass


@functools.lru_cache(maxsize=1)
def find_base() -> CgroupBase | None:
    """Where this process may make per-sandbox memory cgroups, or None (logged once)."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        mounts, own = [], {}
    base = _v2_base(mounts, own) or _v1_base(mounts, own)
    if base is not None:
        _remove_orphans(base)
    if base is None:
        logger.warning("no writable memory cgroup for the code sandbox: its memory limit holds per process, "
                       "not per sandbox (see SECURITY.md)")
    else:
        logger.info("code sandbox memory: one cgroup v%d per run under %s", base.version, base.path)
    return base


class SandboxCgroup:
    """A fresh child cgroup limited to ``memory_bytes`` (swap included where the kernel counts it)."""

    def __init__(self, base: CgroupBase, memory_bytes: int) -> None:
        self.base = base
        self.path = base.path / f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path.mkdir()
        try:
            if base.version == 2:
                (self.path / "memory.max").write_text(str(memory_bytes))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        except OSError:
            self.remove()
            raise
        self._procs = str(self.path / "cgroup.procs")

    def join(self) -> None:
        """Move the calling process into this cgroup; async-signal-safe enough for a preexec_fn
        (one open and one write, no logging, no locks)."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # "0": the writing process itself
        finally:
            os.close(fd)

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the kernel killed for reaching the limit."""
        name = "memory.events" if self.base.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroup; it must be empty (the caller waited for the tree to be gone)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    logger.warning("cannot remove the sandbox cgroup %s: %s", self.path, e)
                    return
                time.sleep(0.01)
