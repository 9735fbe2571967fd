"""The form an answer must take when the gold answer is a number: a number, stated once.

math-verify evaluates what it extracts, so ``\\boxed{513^2 - 487^2}`` equals 26000 and
``\\boxed{\\dbinom{31}{28}}`` equals 4495: an expression copied from the question scores as if it
were the answer. A policy under RL pressure is free to learn that. Hedges score too:
``\\boxed{5\\%}`` equals both 5 and 0.05, and ``\\boxed{x = 7 = 5}`` holds 5.

The rule, for a gold answer that is itself a number (an integer, a decimal or a fraction of two
integers, optionally signed, optionally a percentage):

- the reply's final answer (what math-verify extracts: the last ``\\boxed{}``, else its other
  patterns) must be a number literal: an integer (thousands may be separated by ``,`` or
  ``{,}``), a decimal, or a fraction of two integers in lowest terms (``\\frac{3}{4}``,
  ``\\dfrac``, ``\\tfrac``, ``3/4``), with an optional sign. Nothing left to evaluate: no
  operator, power, root, function, binomial or logarithm;
- one value: at most one ``=``, and only after a variable's name (``x = 7``); no chain of
  equalities, no ``\\pm``, no list or set;
- a percent sign only when the gold has one;
- what is only presentation is ignored: spaces, ``\\$``, a ``\\text{...}`` or ``\\mathbf{...}``
  around the whole, braces around the whole, a degree sign, a final period;
- its value must equal the gold's exactly (``0.75`` for ``\\frac{3}{4}`` scores, ``0.333`` for
  ``\\frac{1}{3}`` does not).

Gold answers that are not numbers (``\\frac{\\sqrt{2}}{2}``, intervals, matrices) keep
math-verify's comparison; the rule does not reach them. The cost on honest answers is measured in
``tests/test_reward_copying.py``: all 311 packaged MATH-500 gold answers, boxed as themselves,
still score 1.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from math import gcd

from megatron_areal.reward.arithmetic import normalise

# Presentation only: spacing commands, \left and \right, dollar signs.
_SPACING = re.compile(r"\\[,!;: ]|\\q?quad|~|\\left|\\right|\\\$|\$|\s+")
_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|textrm|boxed|displaystyle)\{(.*)\}$", re.S)
_DEGREES = re.compile(r"(?:\^\{?\\circ\}?|\\circ|°|\\degree)$")
_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?$")
_DECIMAL = re.compile(r"^[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)$")
_FRACTION = re.compile(r"^([+-]?)(?:\\[dt]?frac(?:\{(-?\d+)\}\{(\d+)\}|(\d)(\d))|(\d+)/(\d+))$")
MAX_LITERAL_CHARS = 1000  # a longer "number" is not an answer a question of this kind has


class NotANumber(ValueError):
    """The answer is not a single number literal; the message says what it is instead."""


@dataclass(frozen=True)
class NumericGold:
    value: Fraction
    percent: bool  # the gold is written as a percentage: the answer may carry the sign too


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return False
    return depth == 0


def _unwrap(text: str) -> str:
    """``text`` without the presentation around the whole of it."""
    while True:
        before = text
        text = text.rstrip(".")
        text = _DEGREES.sub("", text)
        m = _WRAPPERS.match(text)
        if m and _balanced(m.group(1)):
            text = m.group(1)
        elif text.startswith("{") and text.endswith("}") and _balanced(text[1:-1]):
            text = text[1:-1]
        if text == before:
            return text


def literal_value(text: str, percent_allowed: bool) -> tuple[Fraction, bool]:
    """The value of a number literal and whether it carried a percent sign; NotANumber otherwise."""
    text = _unwrap(_SPACING.sub("", normalise(text)).replace("{,}", ","))
    if "=" in text:
        name, _, value = text.partition("=")
        if "=" in value or not _VARIABLE.match(name):
            raise NotANumber("more than one value (an equation or a chain of equalities)")
        text = _unwrap(value)
    percent = text.endswith("%")
    if percent:
        if not percent_allowed:
            raise NotANumber("a percentage where the gold answer is a plain number")
        text = _unwrap(text[:-2] if text.endswith("\\%") else text[:-1])
    if len(text) > MAX_LITERAL_CHARS:
        raise NotANumber(f"a literal of more than {MAX_LITERAL_CHARS} characters")
    if _DECIMAL.match(text):
        return Fraction(text.replace(",", "")), percent
    m = _FRACTION.match(text)
    if m:
        sign, *parts = m.groups()
        p, q = (int(a) for a in [x for x in parts if x is not None])
        if q <= 1 or gcd(p, q) != 1:
            raise NotANumber("a fraction not in lowest terms")
        return Fraction(-p if sign == "-" else p, q), percent  # \frac{-3}{4}: the sign may be inside
    raise NotANumber("an expression to evaluate, not a number")


def numeric_gold(answer: object) -> NumericGold | None:
    """The gold answer as a number, or None when it is not one (math-verify compares those)."""
    text = "" if answer is None else str(answer).strip()
    try:
        value, percent = literal_value(text, percent_allowed=True)
    except NotANumber:
        return None
    return NumericGold(value, percent)


def answer_value(extracted: str, gold: NumericGold) -> Fraction:
    """The value of the reply's final answer under the rule above, or NotANumber saying why not."""
    value, _ = literal_value(extracted, percent_allowed=gold.percent)
    return value
