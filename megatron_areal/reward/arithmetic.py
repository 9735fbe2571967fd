"""Numeric answers: the ``\\boxed{}`` number if the reply has one, else the last number in it.

Small instruct models (SmolLM2-135M) answer "12 + 7 = 19" and never write ``\\boxed{}``, so a
reward that insists on the box has no signal; falling back to the last number keeps the reward
binary and exact while accepting the plain style.

Both the reply and the gold are normalised first (``normalise``): signs that look like ``-`` or
``+`` (U+2212 MINUS SIGN, dashes, full-width and small forms) become ASCII, and every Unicode
decimal digit (full-width, Arabic-Indic, ...) becomes its ASCII digit. Without it ``\\boxed{−19}``
would read as 19 and a gold written ``−7`` would not parse.
"""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Any

from megatron_areal.reward.registry import Verdict

# Characters a reply or a gold may use for a minus or a plus sign.
_MINUS_LIKE = "\u2212\u2010\u2011\u2012\u2013\u2014\u2015\u02d7\u2796\ufe58\ufe63\uff0d"
_PLUS_LIKE = "\u2795\ufb29\ufe62\uff0b"
_SIGNS = str.maketrans({**dict.fromkeys(_MINUS_LIKE, "-"), **dict.fromkeys(_PLUS_LIKE, "+")})


def normalise(text: str) -> str:
    """ASCII signs and digits for their Unicode look-alikes; everything else unchanged."""
    text = text.translate(_SIGNS)
    if text.isascii():
        return text
    return "".join(str(unicodedata.decimal(c)) if not c.isascii() and unicodedata.decimal(c, None) is not None
                   else c for c in text)


# A number: optional sign, digits with optional thousands separators, optional decimals.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def _to_fraction(token: str) -> Fraction:
    return Fraction(token.replace(",", ""))


def extract_number(text: str) -> Fraction | None:
    """The answer a reply gives: the last boxed number, else the last number anywhere."""
    text = normalise(text)
    for content in reversed(_BOXED.findall(text)):
        numbers = _NUMBER.findall(content.replace(" ", ""))
        if numbers:
            return _to_fraction(numbers[-1])
    numbers = _NUMBER.findall(text)
    return _to_fraction(numbers[-1]) if numbers else None


def verify_number(response_text: str, answer: Any) -> Verdict:
    try:
        gold = _to_fraction(normalise(str(answer)).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"gold answer {answer!r} is not a number") from None
    found = extract_number(response_text)
    if found is None:
        return Verdict(0.0, "no number in the reply")
    return Verdict(1.0 if found == gold else 0.0, f"answer {found}")
