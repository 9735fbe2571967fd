"""Run untrusted Python under bubblewrap with resource limits.

What the sandbox contains (see SECURITY.md): read-only binds of ``/usr``, ``/etc``, the ``/bin``,
``/sbin`` and ``/lib*`` links or directories, and the interpreter's prefix when it lives
elsewhere; a fresh ``/proc`` of its own PID namespace; a minimal ``/dev`` (null, zero, full,
random, urandom, tty), read-only; a size-limited ``/dev/shm``; a private size-limited tmpfs as
``/tmp`` and working directory. Nothing else of the host: no ``/run``, ``/var``, ``/home``,
``/root``, ``/tmp`` or ``/opt``, so no host Unix socket is reachable by path, and the network
namespace holds only its own loopback, so no abstract socket or TCP port of the host is either.
New network, PID, IPC, UTS, cgroup and user namespaces. Nothing of the caller's environment:
bubblewrap itself is started with ``SANDBOX_ENV`` only, because the sandbox's PID 1 is a copy of
bubblewrap whose ``/proc/1/environ`` the program can read (``--clearenv`` cleans only the
program's own), and with no file descriptor but its stdin, stdout, stderr and the info pipe, which
it closes before the program starts.

Limits: memory for the whole sandbox (a cgroup per run, ``cgroup.py``, where the service may make
one), and per process (setrlimit before exec) CPU seconds, address space, file size, and the
number of processes of the sandbox's user. At the end of a run, or at the wall-clock limit, the
sandbox's PID-namespace init is killed, and so the kernel kills every process of the namespace;
``run_task`` returns only after that init has exited, which the kernel allows only once every
other process of the namespace is gone, so no process of one answer outlives its verdict.

RLIMIT_NPROC is not enforced for root and counts every process of a user, so when the service runs
as root each sandbox runs as a uid of its own, claimed for the run from an unused range
(``sandbox_user.py``), and one sandbox's processes never count against another's limit. The
interpreter must then be executable by any user: a Python installed under ``/root`` is not, and
the system ``/usr/bin/python3`` is used instead. Without root the sandbox runs as the service's
user, and its limit is that user's count on the host plus ``max_processes`` (see SECURITY.md).

A pass is never read from an exit status: ``harness.py`` (which see) runs the tests and the
answer in separate processes, and only the test process, after the tests' code returned, prints
a nonce that it read before the answer's process existed.

``run_program`` is the sandbox itself: any interpreter arguments, bytes on stdin, and back the
bounded head and tail of stdout and stderr and how the run ended. ``run_task`` is the harness run
through it; the agents' ``python`` tool (``megatron_areal/agent/code_tool.py``) is another program.
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import resource
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.reward.cgroup import SandboxCgroup, find_base
from megatron_areal.reward.sandbox_user import NoSandboxUser, SandboxUser, claim_user

logger = logging.getLogger(__name__)

# bubblewrap's whole environment: it becomes the sandbox's PID 1, whose environment the program can read
SANDBOX_ENV = {"PATH": "/usr/bin:/bin"}
_PR_SET_PDEATHSIG = 1
_STDERR_TAIL = 2000
_STDOUT_LIMIT = 1 << 20  # the proof is one short line; anything else there is noise
_HARNESS = Path(__file__).with_name("harness.py")
_SYSTEM_DIRS = ("/usr", "/etc")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_TREE_GONE_S = 60.0  # how long the kernel may take to empty the sandbox's PID namespace
INSTALL_HINT = ("install the package 'bubblewrap' (Debian/Ubuntu: apt install bubblewrap; Fedora/RHEL: "
                "dnf install bubblewrap); scripts/install.sh installs Python packages only")


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
class SandboxTask:
    """What one run needs: the answer's source, the tests' source, and the task's prompt and
    entry point, which decide what the tests see of the answer (``harness.wanted_names``)."""

    answer: str
    tests: str
    prompt: str = ""
    entry_point: str | None = None


@dataclass(frozen=True)
class OutputBound:
    """How much of a stream ``run_program`` keeps: its first ``head`` and last ``tail`` bytes.
    The rest is never read into memory, so a program cannot flood its caller."""

    head: int
    tail: int


@dataclass(frozen=True)
class CapturedOutput:
    """The kept part of a stream: ``head``, then ``tail`` (the last bytes not already in ``head``),
    and the stream's full ``size``; what lies between them was cut."""

    head: bytes
    tail: bytes
    size: int

    @property
    def cut(self) -> int:
        return self.size - len(self.head) - len(self.tail)

    def text(self) -> str:
        """The kept bytes decoded, with a marker where the middle was cut."""
        head, tail = self.head.decode(errors="replace"), self.tail.decode(errors="replace")
        if not self.cut:
            return head + tail
        return f"{head}\n[... {self.cut:,} bytes cut of {self.size:,} ...]\n{tail}"


@dataclass(frozen=True)
class ProgramRun:
    """How a sandboxed program ended and what it wrote."""

    returncode: int | None  # None when the wall-clock limit killed it
    stdout: CapturedOutput
    stderr: CapturedOutput
    created: bool  # bubblewrap created the sandbox's namespaces; False: it failed before (stderr says why)
    oom_kills: int = 0  # processes the kernel killed at the sandbox's memory limit (cgroup only)


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when the wall-clock limit killed it
    stderr_tail: str
    proven: bool = False  # the test process printed this run's nonce: the tests' code ran to its end
    oom_kills: int = 0  # processes the kernel killed at the sandbox's memory limit (cgroup only)

    @property
    def passed(self) -> bool:
        """Only the proof counts; an exit status of 0 alone means nothing."""
        return self.proven

    def describe(self) -> str:
        if self.proven:
            return "tests passed"
        if self.returncode is None:
            return "killed at the wall-clock limit"
        if self.oom_kills:
            return f"{self.oom_kills} process(es) killed at the sandbox's memory limit"
        if self.returncode < 0:
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        last = self.stderr_tail.strip().splitlines()[-1:] or [""]
        if self.returncode == 0 and not last[0]:
            return "exit 0 without the proof that the tests ran to their end"
        return f"exit {self.returncode}" + (f": {last[0]}" if last[0] else "")


def _runs_as_other_users() -> bool:
    """Root's sandboxes run as uids of their own (``sandbox_user.py``), others' as the caller."""
    return os.geteuid() == 0


def _executable_by_others(path: Path) -> bool:
    """Whether a user with no special rights can execute ``path`` (every parent searchable)."""
    path = path.resolve()
    if not path.is_file() or not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)


def choose_python(configured: str) -> str:
    if configured:
        return configured
    if not _runs_as_other_users() or _executable_by_others(Path(sys.executable)):
        return sys.executable
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system and _executable_by_others(Path(system)):
        return system
    raise SandboxUnavailable(
        f"the sandbox runs as a user of its own (the service runs as root) and cannot execute {sys.executable} "
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


def check_sandbox_available() -> str:
    """The path of ``bwrap``, or SandboxUnavailable naming the package to install."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "the 'code' reward runs answers under bubblewrap, but there is no 'bwrap' on PATH: " + INSTALL_HINT)
    return bwrap


@functools.lru_cache(maxsize=8)
def _interpreter_roots(python: str) -> tuple[str, ...]:
    """Directories the interpreter needs that the system binds do not cover (a venv, pyenv)."""
    try:
        out = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"cannot run the sandbox's interpreter {python}: {e}") from e
    roots = {os.path.realpath(p) for p in [*out, str(Path(python).resolve().parent.parent)]}
    covered = tuple(os.path.realpath(d) for d in (*_SYSTEM_DIRS, *_SYSTEM_LINKS) if os.path.isdir(d))
    return tuple(sorted(r for r in roots if r != "/" and not any(r == c or r.startswith(c + "/") for c in covered)))


def _system_binds(python: str) -> list[str]:
    """Read-only binds of what Python needs, and nothing that holds host sockets (/run, /var, /tmp)."""
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for root in _interpreter_roots(python):
        args += ["--ro-bind", root, root]
    return args


def _harness_program() -> tuple[str, ...]:
    """The interpreter's arguments that start the harness's test process."""
    return ("-c", _HARNESS.read_text(), "tests")


def bwrap_command(python: str, scratch_bytes: int, shm_bytes: int, info_fd: int,
                  program: Sequence[str]) -> list[str]:
    """The bubblewrap command running ``python -I -B`` with ``program``'s arguments in the sandbox."""
    bwrap = check_sandbox_available()
    return [
        bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
        *_system_binds(python),
        "--dev", "/dev", "--size", str(shm_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--proc", "/proc",
        "--size", str(scratch_bytes), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--hostname", "sandbox",
        # -I ignores PYTHON* and the user site; the program reads its input from stdin
        python, "-I", "-B", *program,
    ]


def _limiter(limits: SandboxLimits, max_procs: int, cgroup: SandboxCgroup | None, uid: int):
    # Loaded here, in the parent: the child of a process with threads (the trainer, where the agents'
    # python tool runs) must not take the dynamic loader's lock between fork and exec.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def apply() -> None:  # runs in the child between fork and exec
        if cgroup is not None:
            cgroup.join()  # first, while privileged: every descendant is born inside
        mb = 1024 * 1024
        for kind, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * mb),
                            (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NPROC, max_procs)):
            resource.setrlimit(kind, (value, value))
        if uid != os.geteuid():
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        # Last: a change of credentials clears it. If the worker holding this sandbox is killed,
        # bubblewrap (and so the sandbox) dies too.
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return apply


def run_answer(answer: str, tests: str, limits: SandboxLimits) -> SandboxResult:
    """Run ``tests`` against ``answer``, which gives the tests every name they read but do not define."""
    return run_task(SandboxTask(answer, tests), limits)


def run_task(task: SandboxTask, limits: SandboxLimits) -> SandboxResult:
    """Run the task's tests against its answer in the sandbox; never raises for anything either does.

    The nonce goes in the frame on stdin, which the test process reads to its end before it
    starts the answer's process; the proof comes back on stdout. Returns only once every process
    of the sandbox is gone."""
    nonce = secrets.token_hex(32)
    frame = json.dumps({"nonce": nonce, "answer": task.answer, "tests": task.tests, "prompt": task.prompt,
                        "entry_point": task.entry_point, "runner": _HARNESS.read_text()})
    run = run_program(_harness_program(), frame.encode(), limits, stdout=OutputBound(head=_STDOUT_LIMIT, tail=0),
                      stderr=OutputBound(head=0, tail=4 * _STDERR_TAIL))
    proven = f"pass {nonce}\n".encode() in run.stdout.head
    tail = run.stderr.tail.decode(errors="replace")[-_STDERR_TAIL:]
    return SandboxResult(run.returncode, tail, proven, run.oom_kills)


def run_program(program: Sequence[str], stdin: bytes, limits: SandboxLimits, stdout: OutputBound,
                stderr: OutputBound) -> ProgramRun:
    """Run ``python -I -B *program`` in the sandbox with ``stdin`` as its input, under ``limits``;
    never raises for anything the program does.

    Returns only once every process of the sandbox is gone (``_kill_tree``), with the parts of
    stdout and stderr the bounds keep. Raises SandboxUnavailable when there is no bubblewrap or no
    interpreter the sandbox user can execute."""
    python = choose_python(limits.python)
    user = _claim_user()
    uid = user.uid if user is not None else os.geteuid()
    # The limit counts every process of the user (none but this run's for a claimed uid); allow this
    # run ``max_processes`` more.
    max_procs = _count_processes(uid) + limits.max_processes + 3  # + bwrap, its init, the program's first process
    mb = 1024 * 1024
    base = find_base()
    try:
        cgroup = SandboxCgroup(base, limits.memory_mb * mb) if base is not None else None
    except BaseException:
        if user is not None:
            user.release()
        raise
    info_r, info_w = os.pipe()
    try:
        cmd = bwrap_command(python, 4 * limits.file_mb * mb, limits.file_mb * mb, info_w, program)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=(info_w,),
                                    close_fds=True, env=SANDBOX_ENV, cwd="/", start_new_session=True,
                                    preexec_fn=_limiter(limits, max_procs, cgroup, uid))
            os.close(info_w)
            info_w = -1
            report = _read_info(info_r)
            init = _open_init(report) if report is not None else None
            try:
                proc.communicate(stdin, timeout=limits.wall_s)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_tree(proc, init)
            captured_out, captured_err = _capture(out, stdout), _capture(err, stderr)
        return ProgramRun(code, captured_out, captured_err, report is not None, cgroup.oom_kills() if cgroup else 0)
    finally:
        os.close(info_r)
        if info_w >= 0:
            os.close(info_w)
        if cgroup is not None:
            cgroup.remove()
        if user is not None:
            user.release()  # only now: every process of the run is gone


def _claim_user() -> SandboxUser | None:
    if not _runs_as_other_users():
        return None
    try:
        return claim_user()
    except (NoSandboxUser, OSError) as e:
        raise SandboxUnavailable(f"no user id for the sandbox: {e}") from e


def _capture(stream, bound: OutputBound) -> CapturedOutput:
    """The head and tail of a finished stream's file, reading nothing between them."""
    stream.seek(0)
    head = stream.read(bound.head)
    size = stream.seek(0, os.SEEK_END)
    stream.seek(max(len(head), size - bound.tail))
    return CapturedOutput(head, stream.read(), size)


def _read_info(info_r: int) -> bytes | None:
    """Bubblewrap's ``--info-fd`` report, which it writes once the sandbox's namespaces and their
    init exist; None when it closed the pipe without one (it failed before)."""
    data = b""
    while not data.rstrip().endswith(b"}"):
        chunk = os.read(info_r, 4096)
        if not chunk:
            return None
        data += chunk
    return data


def _open_init(data: bytes) -> int | None:
    """A pidfd of the sandbox's PID-namespace init, named in bubblewrap's ``--info-fd`` report."""
    try:
        pid = int(json.loads(data)["child-pid"])
        return os.pidfd_open(pid)
    except ProcessLookupError:  # already gone, and with it the whole namespace
        return None
    except (ValueError, KeyError, TypeError, OSError) as e:  # OSError: a kernel without pidfd_open
        logger.warning("cannot wait for the sandbox's processes (bubblewrap reported %r): %s", data[:200], e)
        return None


def _kill_tree(proc: subprocess.Popen, init: int | None) -> None:
    """Kill the sandbox and wait until the kernel has removed all its processes.

    Killing the PID namespace's init makes the kernel kill every process in the namespace, and the
    init itself exits (its pidfd becomes readable) only after all of them have been reaped, so
    waiting on it needs no polling and holds however loaded the machine is."""
    try:
        if init is not None:
            try:
                signal.pidfd_send_signal(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if init is not None and not select.select([init], [], [], _TREE_GONE_S)[0]:
            raise RuntimeError(f"the sandbox's processes were still alive {_TREE_GONE_S:.0f}s after SIGKILL")
    finally:
        if init is not None:
            os.close(init)


def check_sandbox(limits: SandboxLimits) -> None:
    """Raise SandboxUnavailable unless bubblewrap is installed, a trivial answer passes its test,
    and an answer cannot reach the network."""
    check_sandbox_available()
    result = run_answer("x = 1\n", "assert x == 1\n", limits)
    if not result.passed:
        raise SandboxUnavailable(
            f"bubblewrap cannot start a sandbox here ({result.describe()}); it needs user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1) or a setuid bwrap. stderr: {result.stderr_tail.strip()}")
    probe = ("import socket\ndef offline():\n    try:\n        socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
             "    except OSError:\n        return True\n    return False\n")
    if not run_answer(probe, "assert offline()\n", limits).passed:
        raise SandboxUnavailable("the code sandbox can reach the network; refusing to run code answers")
    logger.info("code sandbox ready: bubblewrap, %s, %s",
                "a uid of its own per run" if _runs_as_other_users() else f"uid {os.geteuid()}",
                choose_python(limits.python))
