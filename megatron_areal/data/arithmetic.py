"""``a op b`` problems sized for RL on a 135M-parameter instruct model.

``+`` and ``-`` take operands in 0-99, ``*`` takes 0-99 x 0-12: SmolLM2-135M-Instruct solves
about a fifth of these greedily, so most GRPO groups hold both right and wrong answers. The
instruction asks for ``\\boxed{}``; the ``arithmetic`` verifier also accepts the last number,
because a model this small never writes the box.

The held-out set is the first ``size`` problems of a fixed pool of distinct problems drawn from a
constant seed; the training stream, whatever its seed, never yields a problem from that pool.
"""
from __future__ import annotations

import random
from functools import lru_cache

from megatron_areal.data import generated
from megatron_areal.data.prompt import Prompt

Problem = tuple[int, str, int]

HELD_OUT_SEED = 0x5EED_E7A1
HELD_OUT_POOL = 1000  # largest held-out set; all of it is excluded from training
TRAIN_DEFAULT_SIZE = 20_000
_OPS = ("+", "-", "*")


def _draw(rng: random.Random) -> Problem:
    op = rng.choice(_OPS)
    return rng.randrange(100), op, rng.randrange(13 if op == "*" else 100)


def solve(problem: Problem) -> int:
    a, op, b = problem
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def render(problem: Problem) -> str:
    a, op, b = problem
    return f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."


@lru_cache(maxsize=1)
def _held_out_pool() -> tuple[Problem, ...]:
    return generated.held_out_pool(_draw, HELD_OUT_SEED, HELD_OUT_POOL)


def _prompts(problems: list[Problem]) -> list[Prompt]:
    return [Prompt(index=i, text=render(p), answer=str(solve(p)), task="arithmetic") for i, p in enumerate(problems)]


def arithmetic_eval(seed: int = 0, size: int | None = None) -> list[Prompt]:
    """The fixed held-out problems (``seed`` is ignored: the set must not move between runs)."""
    return _prompts(generated.held_out(_held_out_pool(), 200 if size is None else size, "arithmetic-eval"))


def arithmetic_train(seed: int = 0, size: int | None = None) -> list[Prompt]:
    """``size`` problems drawn with replacement from ``seed``, none of them in the held-out pool."""
    size = TRAIN_DEFAULT_SIZE if size is None else size
    return _prompts(generated.training(_draw, _held_out_pool(), seed, size, "arithmetic"))
