"""Math answers checked with math-verify.

math-verify guards its parsing and comparison with ``signal.alarm``, which only works in a main
thread; we switch that off (``parsing_timeout=None, timeout_seconds=None``) because the reward
pool enforces the time limit itself by killing the worker process.
"""
from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify

# math-verify warns on every call that its own timeout is disabled; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def gold_as_latex(answer: Any) -> str:
    """Gold answers are LaTeX fragments; without delimiters ``\\frac{\\sqrt{2}}{2}`` or ``(1, 2)``
    do not parse, so wrap them in ``$...$`` unless they already carry math delimiters."""
    text = "" if answer is None else str(answer).strip()
    if not text:
        raise ValueError("empty gold answer")
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def verify_math(response_text: str, answer: Any) -> float:
    gold = parse(gold_as_latex(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"gold answer {answer!r} does not parse")
    predicted = parse(response_text, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
