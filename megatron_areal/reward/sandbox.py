"""Run untrusted Python under bubblewrap with resource limits.

Isolation (bubblewrap): new network, PID, IPC, UTS and user namespaces; the host file system
mounted read-only; a private size-limited tmpfs as ``/tmp`` and working directory; no inherited
environment. Limits (setrlimit before exec): CPU seconds, address space, file size, and the
number of processes of the sandbox user. The wall-clock limit kills bubblewrap's process group;
because the sandbox has its own PID namespace and bubblewrap's init dies with its parent, the
whole process tree goes with it.

RLIMIT_NPROC is not enforced for root, so when the service runs as root the sandbox runs as
``nobody``. The interpreter must then be executable by ``nobody``: a Python installed under
``/root`` is not, and the system ``/usr/bin/python3`` is used instead.
"""
from __future__ import annotations

import ctypes
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

NOBODY = 65534
_PR_SET_PDEATHSIG = 1
_STDERR_TAIL = 2000


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 6.0
    cpu_s: int = 4
    memory_mb: int = 512
    max_processes: int = 32
    file_mb: int = 16
    python: str = ""  # "" chooses an interpreter the sandbox user can execute


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when the wall-clock limit killed it
    stderr_tail: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        if self.returncode is None:
            return "killed at the wall-clock limit"
        if self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        last = self.stderr_tail.strip().splitlines()[-1:] or [""]
        return f"exit {self.returncode}" + (f": {last[0]}" if last[0] else "")


def _sandbox_uid() -> int:
    return NOBODY if os.geteuid() == 0 else os.geteuid()


def _executable_by_others(path: Path) -> bool:
    """Whether a user with no special rights can execute ``path`` (every parent searchable)."""
    path = path.resolve()
    if not path.is_file() or not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)


def choose_python(configured: str) -> str:
    if configured:
        return configured
    if _sandbox_uid() != NOBODY or _executable_by_others(Path(sys.executable)):
        return sys.executable
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system and _executable_by_others(Path(system)):
        return system
    raise SandboxUnavailable(
        f"the sandbox runs as 'nobody' (the service runs as root) and cannot execute {sys.executable} "
        "or a system python3; set reward.code_python to an interpreter outside /root")


def _count_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat(follow_symlinks=False).st_uid == uid
            except OSError:  # the process exited while we looked
                pass
    return count


def bwrap_command(python: str, scratch_bytes: int) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap ('bwrap') is not installed: apt-get install -y bubblewrap")
    return [
        bwrap, "--unshare-all", "--die-with-parent", "--new-session",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--size", str(scratch_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--hostname", "sandbox",
        python, "-I", "-B", "-",  # the program comes on stdin; -I ignores PYTHON* and user site
    ]


def _limiter(limits: SandboxLimits, max_procs: int):
    def apply() -> None:  # runs in the child between fork and exec, after the uid switch
        mb = 1024 * 1024
        for kind, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * mb),
                            (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NPROC, max_procs)):
            resource.setrlimit(kind, (value, value))
        # If the worker holding this sandbox is killed, bubblewrap (and so the sandbox) dies too.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return apply


def run_python(program: str, limits: SandboxLimits) -> SandboxResult:
    """Run ``program`` in the sandbox; never raises for anything the program does."""
    uid = _sandbox_uid()
    # The limit counts every process of the user; allow this run ``max_processes`` more.
    max_procs = _count_processes(uid) + limits.max_processes + 2  # + bwrap and its init
    cmd = bwrap_command(choose_python(limits.python), 4 * limits.file_mb * 1024 * 1024)
    switch = {"user": uid, "group": uid, "extra_groups": []} if uid != os.geteuid() else {}
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                                cwd="/", start_new_session=True, preexec_fn=_limiter(limits, max_procs),
                                **switch)
        try:
            proc.communicate(program.encode(), timeout=limits.wall_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(proc)
        stderr.seek(0)
        tail = stderr.read()[-_STDERR_TAIL:].decode(errors="replace")
    return SandboxResult(code, tail)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def check_sandbox(limits: SandboxLimits) -> None:
    """Raise SandboxUnavailable unless a trivial program runs and cannot reach the network."""
    probe = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n" \
            "except OSError:\n    raise SystemExit(0)\nraise SystemExit(3)\n"
    result = run_python(probe, limits)
    if result.returncode == 3:
        raise SandboxUnavailable("the code sandbox can reach the network; refusing to run code answers")
    if not result.passed:
        raise SandboxUnavailable(
            f"bubblewrap cannot start a sandbox here ({result.describe()}); it needs user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1) or a setuid bwrap. stderr: {result.stderr_tail.strip()}")
    logger.info("code sandbox ready: bubblewrap, uid %d, %s", _sandbox_uid(), choose_python(limits.python))
