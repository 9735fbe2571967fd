"""Numeric answers: the ``\\boxed{}`` number if the reply has one, else the last number in it.

Small instruct models (SmolLM2-135M) answer "12 + 7 = 19" and never write ``\\boxed{}``, so a
reward that insists on the box has no signal; falling back to the last number keeps the reward
binary and exact while accepting the plain style.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from megatron_areal.reward.registry import Verdict

# A number: optional sign, digits with optional thousands separators, optional decimals.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def _to_fraction(token: str) -> Fraction:
    return Fraction(token.replace(",", ""))


def extract_number(text: str) -> Fraction | None:
    """The answer a reply gives: the last boxed number, else the last number anywhere."""
    for content in reversed(_BOXED.findall(text)):
        numbers = _NUMBER.findall(content.replace(" ", ""))
        if numbers:
            return _to_fraction(numbers[-1])
    numbers = _NUMBER.findall(text)
    return _to_fraction(numbers[-1]) if numbers else None


def verify_number(response_text: str, answer: Any) -> Verdict:
    try:
        gold = _to_fraction(str(answer).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"gold answer {answer!r} is not a number") from None
    found = extract_number(response_text)
    if found is None:
        return Verdict(0.0, "no number in the reply")
    return Verdict(1.0 if found == gold else 0.0, f"answer {found}")
