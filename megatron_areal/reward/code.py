"""Code answers: the reply's Python runs against unit tests in the sandbox; all pass -> 1.

``answer`` is a mapping with ``tests`` (Python source that raises on failure), optionally
``entry_point`` (HumanEval style: the tests define ``check(candidate)``, called with that
function) and ``prefix`` (the problem's code, put in front when the reply only gives a body).

The reply and the tests run in separate processes of the sandbox (``harness.py``). The tests see
the entry point (or, without one, the names they read but do not define), never a built-in's name;
the prefix's own definitions come from the prefix. They call the reply's functions through a pipe
and get back plain data rebuilt from built-in types, so their comparisons cannot be overridden.
A pass is the test process's proof that the tests' code ran to its end, never an exit status,
so exiting early scores 0. Tests that rely on the reply mutating their arguments in place fail,
because arguments cross as copies, and so do replies whose functions return objects other than
plain data. See SECURITY.md.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_areal.reward.registry import Verdict
from megatron_areal.reward.sandbox import SandboxLimits, SandboxTask, check_sandbox, run_task

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response_text: str) -> str:
    """The last fenced code block that is not empty, else the whole reply."""
    blocks = [b for b in _FENCE.findall(response_text) if b.strip()]
    return blocks[-1] if blocks else response_text


def build_program(response_text: str, answer: Mapping[str, Any]) -> SandboxTask:
    """The answer's source (the reply's code, after the prefix when it only gives a body), the
    tests' source (ending with ``check(entry_point)`` when there is one), the prefix and the
    entry point."""
    tests = answer.get("tests")
    if not isinstance(tests, str) or not tests.strip():
        raise ValueError("a code answer needs non-empty 'tests' source")
    code = extract_code(response_text)
    entry = answer.get("entry_point") or None
    if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
        raise ValueError(f"a code answer's 'entry_point' must be a Python name, got {entry!r}")
    prefix = answer.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"a code answer's 'prefix' must be source text, got {type(prefix).__name__}")
    if prefix and (entry is None or not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE)):
        code = prefix + code  # a completion that continues the given signature
    if entry:
        tests = f"{tests}\n\ncheck({entry})"
    return SandboxTask(answer=code + "\n", tests=tests + "\n", prompt=prefix, entry_point=entry)


@dataclass(frozen=True)
class CodeVerifier:
    limits: SandboxLimits = SandboxLimits()

    def __call__(self, response_text: str, answer: Any) -> Verdict:
        if not isinstance(answer, Mapping):
            raise TypeError(f"a code answer must be a mapping with 'tests', got {type(answer).__name__}")
        result = run_task(build_program(response_text, answer), self.limits)
        return Verdict(1.0 if result.passed else 0.0, result.describe())

    def preflight(self) -> None:
        check_sandbox(self.limits)
