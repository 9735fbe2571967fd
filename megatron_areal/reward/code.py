"""Code answers: the reply's Python runs against unit tests in the sandbox; all pass -> 1.

``answer`` is a mapping with ``tests`` (Python source that raises on failure), optionally
``entry_point`` (HumanEval style: the tests define ``check(candidate)``, called with that
function) and ``prefix`` (the problem's code, put in front when the reply only gives a body).

The reply and the tests run in separate processes of the sandbox (``harness.py``): the tests
call the reply's functions through a pipe and see only plain data and opaque handles in return,
and a pass is the test process's proof that the tests' code ran to its end, never an exit status.
So exiting early (``os._exit``, ``sys.exit``, ``SystemExit``, ``atexit``, signals) scores 0.
What it does not prevent: objects of the reply (not plain data) answer for their own ``==``,
truth value and other operators, as they would in one process; tests that only check such
objects can be fooled by them. Tests that rely on the reply mutating their arguments in place
fail, because arguments cross as copies. See SECURITY.md.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_areal.reward.registry import Verdict
from megatron_areal.reward.sandbox import SandboxLimits, check_sandbox, run_answer

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response_text: str) -> str:
    """The last fenced code block that is not empty, else the whole reply."""
    blocks = [b for b in _FENCE.findall(response_text) if b.strip()]
    return blocks[-1] if blocks else response_text


def build_program(response_text: str, answer: Mapping[str, Any]) -> tuple[str, str]:
    """The answer's source (the reply's code, after the prefix when it only gives a body) and
    the tests' source (ending with ``check(entry_point)`` when there is one)."""
    tests = answer.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError("a code answer needs non-empty 'tests' source")
    code = extract_code(response_text)
    entry = answer.get("entry_point") or None
    prefix = answer.get("prefix") or ""
    if prefix and (entry is None or not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE)):
        code = prefix + code  # a completion that continues the given signature
    if entry:
        tests = f"{tests}\n\ncheck({entry})"
    return code + "\n", tests + "\n"


@dataclass(frozen=True)
class CodeVerifier:
    limits: SandboxLimits = SandboxLimits()

    def __call__(self, response_text: str, answer: Any) -> Verdict:
        if not isinstance(answer, Mapping):
            raise TypeError(f"a code answer must be a mapping with 'tests', got {type(answer).__name__}")
        result = run_answer(*build_program(response_text, answer), self.limits)
        return Verdict(1.0 if result.passed else 0.0, result.describe())

    def preflight(self) -> None:
        check_sandbox(self.limits)
