"""The ``python`` tool: an agent's model runs a program in the reward's code sandbox and reads what it printed.

The program runs under ``megatron_areal/reward/sandbox.py`` exactly as code answers do (bubblewrap,
no network, a private scratch ``/tmp``, the CPU, memory, file-size, process and wall-clock limits of
a ``SandboxLimits``, every process killed at the end), off the event loop, so a tool that computes,
hangs or floods its output costs one bounded thread and never the rollout loop. Its answer is the
text the model reads: stdout, then stderr, each cut to a few KB around a marker, then one line
saying how the program ended when it did not exit 0.

Nothing the code does raises. A host without a working sandbox raises ``SandboxUnavailable``:
``check_python_tool`` at the import of the agent's module makes the run refuse at its start
rather than fail one episode after another.
"""
from __future__ import annotations

import asyncio
import signal
from typing import Any

from megatron_areal.reward.sandbox import (
    OutputBound,
    ProgramRun,
    SandboxLimits,
    SandboxUnavailable,
    check_sandbox,
    run_program,
)

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python 3 program and read what it prints (stdout, then stderr). No network; "
                   "files written under /tmp last for this run only.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                   "required": ["code"]}}}
# What the model reads of each stream: a program that prints megabytes costs it about 10 KB.
STDOUT_BOUND = OutputBound(head=4096, tail=2048)
STDERR_BOUND = OutputBound(head=1024, tail=3072)  # a traceback's end says what went wrong
# Inside the sandbox: the program goes to /tmp/main.py (so tracebacks show its lines), stdin is
# emptied, and a fresh unbuffered interpreter runs it (so what it printed before a kill comes back).
_LAUNCHER = ("import os, sys\n"
             "source = sys.stdin.buffer.read()\n"
             "with open('main.py', 'wb') as f:\n"
             "    f.write(source)\n"
             "null = os.open(os.devnull, os.O_RDONLY)\n"
             "os.dup2(null, 0)\n"
             "os.execv(sys.executable, [sys.executable, '-I', '-B', '-u', 'main.py'])\n")


async def run_python(code: str, limits: SandboxLimits) -> str:
    """What the model reads after running ``code`` in the sandbox: its output and, unless it exited 0,
    how it ended. Runs in a thread, which returns once every process of the program is gone (soon
    after ``limits.wall_s`` at the latest, also when the episode awaiting it was cancelled)."""
    return await asyncio.to_thread(run_python_sync, code, limits)


async def python_tool_call(arguments: Any, limits: SandboxLimits) -> str:
    """``run_python`` of a tool call's arguments (``{"code": "..."}``)."""
    return await run_python(arguments.get("code") if isinstance(arguments, dict) else None, limits)


def run_python_sync(code: str, limits: SandboxLimits) -> str:
    """``run_python`` on the calling thread."""
    if not isinstance(code, str):
        return f'error: expected {{"code": "<a Python program>"}}, got a {type(code).__name__} for the program\n'
    run = run_program(("-c", _LAUNCHER), code.encode(errors="replace"), limits, STDOUT_BOUND, STDERR_BOUND)
    if not run.created:
        raise SandboxUnavailable(f"bubblewrap could not create a sandbox: {run.stderr.text().strip()[:500]}")
    return tool_answer(run, limits)


def tool_answer(run: ProgramRun, limits: SandboxLimits) -> str:
    """stdout, then stderr if any, then the status line if the program did not exit 0."""
    parts = [text if text.endswith("\n") else text + "\n"
             for text in (run.stdout.text(), run.stderr.text()) if text]
    status = end_status(run, limits)
    if status:
        parts.append(status + "\n")
    return "".join(parts) or "[no output]\n"


def end_status(run: ProgramRun, limits: SandboxLimits) -> str:
    """One line on how the program ended; empty when it exited 0."""
    if run.returncode is None:
        return f"[killed at the {limits.wall_s:g} s wall-clock limit]"
    if run.oom_kills:
        return f"[{run.oom_kills} process(es) killed at the {limits.memory_mb} MB memory limit]"
    if not run.returncode:
        return ""
    killer = _signal_name(run.returncode)
    if killer is None:
        return f"[exit code {run.returncode}]"
    why = {"SIGKILL": f", which the {limits.cpu_s} CPU-second limit sends",
           "SIGXCPU": f" at the {limits.cpu_s} CPU-second limit",
           "SIGXFSZ": f" at the {limits.file_mb} MB limit on a file or on the output"}.get(killer, "")
    return f"[exit code {run.returncode}: killed by {killer}{why}]"


def _signal_name(returncode: int) -> str | None:
    """The signal that ended the program: bubblewrap exits 128 + n when its program died of signal n
    (as a shell reports it), and a negative code is bubblewrap's own death."""
    number = -returncode if returncode < 0 else returncode - 128
    try:
        return signal.Signals(number).name if number > 0 else None
    except ValueError:
        return None


def check_python_tool(limits: SandboxLimits) -> None:
    """Raise SandboxUnavailable unless the sandbox works here, has no network, and runs a program.
    Call it where the agent's module is imported, so a run on a host without it refuses at start."""
    check_sandbox(limits)
    answer = run_python_sync("print(6 * 7)", limits)
    if answer != "42\n":
        raise SandboxUnavailable(f"the python tool's sandbox does not run a program: {answer.strip()[:500]}")
