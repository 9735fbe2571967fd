"""Math answers checked with math-verify, with a bounded cost per answer.

math-verify parses LaTeX into unevaluated sympy expressions and then evaluates them to compare.
A reply such as ``9^{9^{9^{9}}}`` or ``1000000!`` parses in well under a second but would be
evaluated inside one long C call that no signal interrupts, so before comparing, every power
and factorial of numbers in the parsed reply is sized from logarithms (``estimated_digits``) and
a reply holding one of more than ``MAX_DIGITS`` digits scores 0 unless the gold is as large.

The rest is bounded by a per-answer budget of CPU seconds (``deadline_s``), enforced with
``ITIMER_PROF`` when the verifier runs in a main thread (as in the reward workers): a reply that
exceeds it scores 0 and the worker goes on with the next one. CPU time, not wall-clock time, so
that a loaded machine does not turn a correct answer into a 0. math-verify's own ``signal.alarm``
timeouts are switched off (``parsing_timeout=None, timeout_seconds=None``) because they count
whole seconds, apply per call and would replace our handler.

When the gold answer is a number, the reply's final answer must be a number too, stated once and
in lowest terms (``math_form.py``): an expression copied from the question (``\\boxed{513^2 -
487^2}`` for 26000) or a hedge (``\\boxed{x = 7 = 5}``, ``\\boxed{5\\%}`` for 5) scores 0, although
math-verify alone would evaluate it to the gold.
"""
from __future__ import annotations

import logging
import math
import signal
import threading
from dataclasses import dataclass
from typing import Any

import sympy
from math_verify import parse, verify

from megatron_areal.reward.math_form import NotANumber, NumericGold, answer_value, numeric_gold
from megatron_areal.reward.registry import Verdict

# math-verify warns on every call that its own timeout is disabled; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_DIGITS = 100_000  # larger numbers are refused before evaluation (2^{100000} has 30,103 digits)
DEFAULT_DEADLINE_S = 3.0  # CPU seconds


class _DeadlineExceeded(BaseException):
    """A BaseException, so that math-verify's and sympy's ``except Exception`` do not swallow it."""


def gold_as_latex(answer: Any) -> str:
    """Gold answers are LaTeX fragments; without delimiters ``\\frac{\\sqrt{2}}{2}`` or ``(1, 2)``
    do not parse, so wrap them in ``$...$`` unless they already carry math delimiters."""
    text = "" if answer is None else str(answer).strip()
    if not text:
        raise ValueError("empty gold answer")
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def _log10_size(expr: sympy.Basic) -> float | None:
    """An upper estimate of log10 of ``|expr|`` for numbers built from powers, factorials, products
    and sums of numbers, without evaluating them; None for anything else (symbols, functions)."""
    if isinstance(expr, sympy.Integer):
        return math.log10(abs(int(expr))) if expr != 0 else 0.0
    if isinstance(expr, sympy.Rational):
        return max(math.log10(abs(expr.p) or 1), math.log10(expr.q))
    if isinstance(expr, sympy.Float):
        return math.log10(abs(float(expr))) if float(expr) != 0 else 0.0
    if isinstance(expr, sympy.Pow):
        base, exponent = _log10_size(expr.base), _log10_size(expr.exp)
        if base is None or exponent is None:
            return None
        if exponent > 300:  # an exponent above 10^300: the result cannot be sized as a float
            return math.inf
        return abs(base) * 10.0 ** exponent
    if isinstance(expr, sympy.factorial):
        n = _log10_size(expr.args[0])
        if n is None:
            return None
        if n > 15:
            return math.inf
        return math.lgamma(10.0 ** n + 1) / math.log(10)
    if isinstance(expr, (sympy.Mul, sympy.Add)):
        sizes = [_log10_size(a) for a in expr.args]
        known = [s for s in sizes if s is not None]
        if not known:
            return None
        return sum(known) if isinstance(expr, sympy.Mul) else max(known) + math.log10(len(sizes))
    return None


def estimated_digits(expr: Any) -> float:
    """The largest digit count of any numeric power or factorial inside ``expr`` (0 when none)."""
    if not isinstance(expr, sympy.Basic):
        return 0.0
    largest = 0.0
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, (sympy.Pow, sympy.factorial)):
            size = _log10_size(node)
            if size is not None:
                largest = max(largest, size)
    return largest


def _too_large(parsed: list[Any]) -> bool:
    return any(estimated_digits(item) > MAX_DIGITS for item in parsed)


class _Deadline:
    """Raise ``_DeadlineExceeded`` in this thread after ``seconds`` of the process's CPU time; a no-op
    outside the main thread, where signals cannot be delivered (the pool's timeout still bounds
    the worker)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = threading.current_thread() is threading.main_thread() and seconds > 0

    def _expire(self, signum: int, frame: object) -> None:
        raise _DeadlineExceeded

    def __enter__(self) -> _Deadline:
        if self.armed:
            self._previous = signal.signal(signal.SIGPROF, self._expire)
            signal.setitimer(signal.ITIMER_PROF, self.seconds)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, self._previous)


def check_math(response_text: str, answer: Any, deadline_s: float = DEFAULT_DEADLINE_S) -> Verdict:
    """1.0 when the reply's answer equals the gold (a number literal when the gold is a number);
    refuses giant numbers and stops at the deadline."""
    gold = parse(gold_as_latex(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"gold answer {answer!r} does not parse")
    number = numeric_gold(answer)
    try:
        with _Deadline(deadline_s):
            predicted = parse(response_text, parsing_timeout=None)
            if not predicted:
                return Verdict(0.0, "no answer found")
            if number is not None:
                return _check_number(predicted, number)
            if _too_large(predicted) and not _too_large(gold):
                return Verdict(0.0, f"refused: the answer holds a number of more than {MAX_DIGITS} digits")
            equal = verify(gold, predicted, timeout_seconds=None)
    except _DeadlineExceeded:
        return Verdict(0.0, f"verification exceeded its {deadline_s} CPU seconds")
    return Verdict(1.0 if equal else 0.0, f"answer {predicted[-1]}")


def _check_number(predicted: list[Any], gold: NumericGold) -> Verdict:
    """The reply's final answer, as math-verify extracted it (its last item, the text), against a
    numeric gold: by the value of the literal it must be, never by evaluating it."""
    extracted = predicted[-1]
    if not isinstance(extracted, str):
        return Verdict(0.0, "no answer found")
    shown = extracted if len(extracted) <= 200 else extracted[:200] + "..."
    try:
        value = answer_value(extracted, gold)
    except NotANumber as e:
        return Verdict(0.0, f"refused: the gold is a number and the answer {shown!r} is {e}")
    return Verdict(1.0 if value == gold.value else 0.0, f"answer {shown}")


def verify_math(response_text: str, answer: Any) -> float:
    """The reward alone, with the default deadline."""
    return check_math(response_text, answer).reward


@dataclass(frozen=True)
class MathVerifier:
    """The ``math`` task's verifier with its per-answer deadline (``reward.math_deadline_s``)."""

    deadline_s: float = DEFAULT_DEADLINE_S

    def __call__(self, response_text: str, answer: Any) -> Verdict:
        return check_math(response_text, answer, self.deadline_s)
