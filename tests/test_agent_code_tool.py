"""The agents' ``python`` tool against the real bubblewrap sandbox: what comes back, and what is stopped.

Every program is bounded by the sandbox's own limits, kept small here (2-3 s wall clock) so the file
stays fast; the network probe uses a 1 s connect time-out.
"""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from megatron_areal.agent.code_tool import (
    PYTHON_TOOL,
    STDERR_BOUND,
    STDOUT_BOUND,
    check_python_tool,
    python_tool_call,
    run_python,
)
from megatron_areal.reward.sandbox import CapturedOutput, SandboxLimits, SandboxUnavailable

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt install bubblewrap)")

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=4, memory_mb=256, max_processes=16, file_mb=16)


def run(code: str, limits: SandboxLimits = LIMITS) -> str:
    return asyncio.run(run_python(code, limits))


def test_schema_offers_one_string_argument_named_code() -> None:
    function = PYTHON_TOOL["function"]
    assert function["name"] == "python"
    assert function["parameters"]["properties"] == {"code": {"type": "string", "description": "The program."}}
    assert function["parameters"]["required"] == ["code"]


def test_prints_come_back_and_an_exit_0_has_no_status() -> None:
    assert run("print(6 * 7)\nprint('héllo')\n") == "42\nhéllo\n"
    assert run("x = 1\n") == "[no output]\n"


def test_an_exception_gives_stdout_then_the_traceback_tail_then_the_status() -> None:
    answer = run("print('before')\ndef parse(s):\n    raise ValueError(f'bad input {s}')\nparse(7)\n")
    assert answer.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "/tmp/main.py", line 4' in answer and "raise ValueError(f'bad input {s}')" in answer
    assert answer.endswith("ValueError: bad input 7\n[exit code 1]\n")


def test_an_endless_loop_is_stopped_at_the_wall_clock_limit_and_says_so() -> None:
    start = time.monotonic()
    answer = run("print('started')\nwhile True:\n    pass\n")
    assert time.monotonic() - start < LIMITS.wall_s + 10
    assert answer == "started\n[killed at the 2 s wall-clock limit]\n"


def test_the_network_is_unreachable_inside() -> None:
    answer = run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                 "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    assert answer.startswith("refused "), answer


def test_a_10_mb_print_is_cut_to_the_bound_with_a_marker() -> None:
    answer = run("print('a' + 'x' * 10_000_000 + 'z')\n")
    bound = STDOUT_BOUND.head + STDOUT_BOUND.tail + STDERR_BOUND.head + STDERR_BOUND.tail + 200
    assert len(answer) < bound
    assert answer.startswith("a" + "x" * 100) and answer.endswith("x" * 100 + "z\n")
    assert f"bytes cut of {10_000_003:,}" in answer


def test_only_the_scratch_directory_is_writable() -> None:
    answer = run("open('/tmp/notes.txt', 'w').write('kept')\nprint(open('/tmp/notes.txt').read())\n"
                 "for path in ('/etc/x', '/usr/x', '/x', '/home/x'):\n"
                 "    try:\n        open(path, 'w')\n        print('wrote', path)\n"
                 "    except OSError as e:\n        print('refused', path, e.errno)\n")
    lines = answer.splitlines()
    assert lines[0] == "kept"
    assert [line.split()[:2] for line in lines[1:]] == [["refused", p] for p in ("/etc/x", "/usr/x", "/x", "/home/x")]


def test_the_event_loop_keeps_running_while_a_program_sleeps() -> None:
    async def scenario() -> tuple[str, int, float]:
        ticks, longest_gap = 0, 0.0
        tool = asyncio.create_task(run_python("import time\ntime.sleep(2)\nprint('slept')\n",
                                              SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256)))
        last = time.monotonic()
        while not tool.done():
            await asyncio.sleep(0.05)
            now = time.monotonic()
            ticks, longest_gap, last = ticks + 1, max(longest_gap, now - last), now
        return tool.result(), ticks, longest_gap

    answer, ticks, longest_gap = asyncio.run(scenario())
    assert answer == "slept\n"
    assert ticks >= 10 and longest_gap < 1.0, (ticks, longest_gap)


def test_arguments_that_are_not_a_program_get_an_error_text() -> None:
    assert asyncio.run(python_tool_call({"code": "print(1)"}, LIMITS)) == "1\n"
    for arguments in (None, {}, {"code": 7}, ["print(1)"]):
        assert asyncio.run(python_tool_call(arguments, LIMITS)).startswith('error: expected {"code"')


def test_without_bubblewrap_the_tool_raises_sandbox_unavailable(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run("print(1)\n")


def test_the_start_check_passes_here_and_refuses_without_bubblewrap(monkeypatch) -> None:
    check_python_tool(LIMITS)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="install.*bubblewrap"):
        check_python_tool(LIMITS)


def test_captured_output_marks_what_was_cut() -> None:
    assert CapturedOutput(b"abc", b"", 3).text() == "abc"
    assert CapturedOutput(b"ab", b"yz", 10).text() == "ab\n[... 6 bytes cut of 10 ...]\nyz"
