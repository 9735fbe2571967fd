"""What one sandbox can see of the host and of the other sandboxes, with real bubblewrap.

- The host's environment: the test sets secrets in its own environment (as a trainer or a reward
  service holding an API key and cloud credentials would have them), then runs model-style code
  that reads every ``/proc/*/environ``, ``/proc/*/cmdline`` and ``/proc/*/task/*/environ`` it can,
  and every file descriptor it holds or can open through ``/proc/*/fd``, through the agents'
  ``python`` tool and through the code reward; neither the tool's answer nor the verdict may hold
  a secret.
- Processes: one sample's fork bomb runs beside another sample that needs a child process; the
  bomb must stay within its own limit and the other sample must still score.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import threading
import time

import pytest

from megatron_areal.agent.code_tool import run_python
from megatron_areal.reward import RewardConfig, RewardService
from megatron_areal.reward.sandbox import SandboxLimits, SandboxTask, run_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt install bubblewrap)")

# What an attacker's code does: collect every NAME=value pair it can read anywhere, print the names
# it found and the values of anything that looks like a credential.
SCANNER = r'''
import os, re, sys

def read(path, limit=1 << 20):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)

def listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []

blobs = {}
for pid in listdir("/proc"):
    if not (pid.isdigit() or pid in ("self", "thread-self")):
        continue
    base = "/proc/" + pid
    for name in ("environ", "cmdline"):
        blobs[base + "/" + name] = read(base + "/" + name)
    for tid in listdir(base + "/task"):
        blobs[f"{base}/task/{tid}/environ"] = read(f"{base}/task/{tid}/environ")
    for fd in listdir(base + "/fd"):
        blobs[f"{base}/fd/{fd}"] = read(f"{base}/fd/{fd}")
for fd in range(3, 256):  # descriptors inherited without a name in /proc
    try:
        blobs[f"fd {fd}"] = os.pread(fd, 1 << 20, 0)
    except OSError:
        pass
names, leaks = set(), []
for where, blob in blobs.items():
    for pair in re.split(rb"[\0\n]", blob):
        m = re.match(rb"([A-Za-z_][A-Za-z0-9_]*)=(.*)", pair)
        if m:
            names.add(m.group(1).decode(errors="replace"))
            if re.search(rb"KEY|SECRET|TOKEN|PASSWORD", m.group(1)):
                leaks.append(f"{where}: {pair.decode(errors='replace')}")
report = f"environment names seen: {sorted(names)}; credentials: {leaks}"
'''
TOOL_PROGRAM = SCANNER + "print(report)\n"
# As a code answer: the report goes to stderr and into the error that ends the run, which the
# verdict describes.
ANSWER_PROGRAM = SCANNER + "print(report, file=sys.stderr)\nraise RuntimeError(report)\n"


@pytest.fixture
def host_secrets(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    values = {"AWS_SECRET_ACCESS_KEY": "aws-" + secrets.token_hex(16),
              "MEGATRON_AREAL_API_KEY": "key-" + secrets.token_hex(16),
              "HF_TOKEN": "hf_" + secrets.token_hex(16)}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def _assert_nothing_of(host: dict[str, str], text: str) -> None:
    # The scanner really read environments: it saw the one the sandbox sets for its program.
    assert "'PATH'" in text and "'HOME'" in text, text[-2000:]
    for name, value in host.items():
        assert value not in text, f"{name}'s value is readable in the sandbox: {text[-2000:]}"
        assert f"'{name}'" not in text, f"{name} is readable in the sandbox: {text[-2000:]}"


def test_the_python_tool_reads_nothing_of_the_hosts_environment(host_secrets: dict[str, str]) -> None:
    limits = SandboxLimits(wall_s=10.0, cpu_s=8, memory_mb=256, max_processes=16, file_mb=16)
    answer = asyncio.run(run_python(TOOL_PROGRAM, limits))
    assert "environment names seen" in answer, answer
    _assert_nothing_of(host_secrets, answer)


def test_a_code_answer_reads_nothing_of_the_hosts_environment(host_secrets: dict[str, str]) -> None:
    limits = SandboxLimits(wall_s=10.0, cpu_s=8, memory_mb=256, max_processes=16, file_mb=16)
    result = run_task(SandboxTask(ANSWER_PROGRAM, "assert True\n"), limits)
    assert not result.passed
    assert "environment names seen" in result.stderr_tail, result.stderr_tail
    _assert_nothing_of(host_secrets, result.stderr_tail + result.describe())


def test_the_code_verdict_holds_nothing_of_the_services_environment(host_secrets: dict[str, str]) -> None:
    # The service's workers start after the secrets are set, so they hold them as a real service would.
    config = RewardConfig(workers=1, timeout_s=20.0, code_wall_s=10.0, code_cpu_s=8, code_memory_mb=256,
                          code_max_processes=16, code_file_mb=16)
    with RewardService(config, tasks=["code"]) as service:
        result = service.score_sync("code", f"```python\n{ANSWER_PROGRAM}```", {"tests": "assert True\n"})
    assert result.reward == 0.0
    assert "environment names seen" in result.detail, result.detail
    _assert_nothing_of(host_secrets, result.detail)


# ---- processes: one sandbox's fork bomb against another's correct answer ----------------------

FORK_BOMB = """
import os, sys, time
n, failed = 0, False
while True:  # until the wall-clock limit: any process slot that frees up is taken at once
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError as e:
        if not failed:
            print(f"forked {n} then {type(e).__name__}", file=sys.stderr, flush=True)
            failed = True
        time.sleep(0.001)
"""
# A correct answer that needs one child process, a few seconds in, when its neighbour's bomb has gone off.
NEEDS_A_CHILD = """
import os, time
def compute(x):
    time.sleep(3)
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return x * os.waitstatus_to_exitcode(status)
"""
BOMB_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=4, memory_mb=256, max_processes=16, file_mb=16)
HONEST_LIMITS = SandboxLimits(wall_s=20.0, cpu_s=4, memory_mb=256, max_processes=16, file_mb=16)


@pytest.mark.parametrize("trial", range(3))
def test_a_fork_bomb_beside_a_correct_answer_does_not_fail_it(trial: int) -> None:
    results = {}

    def run(name: str, task: SandboxTask, limits: SandboxLimits) -> None:
        results[name] = run_task(task, limits)

    honest_task = SandboxTask(NEEDS_A_CHILD, "assert compute(6) == 42\n")
    honest_thread = threading.Thread(target=run, args=("honest", honest_task, HONEST_LIMITS))
    bomb_thread = threading.Thread(target=run, args=("bomb", SandboxTask(FORK_BOMB, "assert False\n"), BOMB_LIMITS))
    honest_thread.start()
    time.sleep(0.3)  # the bomb starts second, as a later sample of the same batch would
    bomb_thread.start()
    for t in (honest_thread, bomb_thread):
        t.join(timeout=120)
    honest, bomb = results["honest"], results["bomb"]
    assert honest.passed, f"the correct answer failed beside a fork bomb: {honest.describe()}\n{honest.stderr_tail}"
    # The bomb stayed within its own limit (its processes, the answer's and the tests' interpreters).
    assert not bomb.passed
    counts = [int(line.split()[1]) for line in bomb.stderr_tail.splitlines() if line.startswith("forked ")]
    assert counts and counts[0] <= BOMB_LIMITS.max_processes, bomb.stderr_tail


@pytest.mark.skipif(os.geteuid() != 0, reason="without root every sandbox runs as the caller (SECURITY.md)")
def test_sandboxes_running_together_have_users_of_their_own() -> None:
    limits = SandboxLimits(wall_s=15.0, cpu_s=4, memory_mb=256, max_processes=16, file_mb=16)

    async def together() -> list[str]:
        program = "import os, time\ntime.sleep(2)\nprint(os.getuid(), os.getgid())\n"
        return await asyncio.gather(*(run_python(program, limits) for _ in range(3)))

    answers = asyncio.run(together())
    users = {int(a.split()[0]) for a in answers}
    assert len(users) == 3 and not users & {0, os.geteuid()}, answers
