"""Products too large to work out in the head, for an agent with a ``calculator`` tool.

Each problem is ``a * b`` with a three-digit ``a`` and a two-digit ``b``: SmolLM2-135M-Instruct
almost never gets such a product right on its own, and gets it right nearly always once it has
called the calculator and copies the result. The conversation opens with one worked example (a
call written in the Hermes ``<tool_call>`` format, the tool's answer, the final reply), so the
format is in the context of even a template that renders no ``tools``. The built-in agent
(``megatron_areal/agent/calculator_task.py``) plays the episodes.

The held-out set is the first ``size`` problems of a fixed pool drawn from a constant seed; the
training stream never yields a problem from that pool.
"""
from __future__ import annotations

import json
import random
from functools import lru_cache

from megatron_areal.data import generated
from megatron_areal.data.prompt import Prompt

Problem = tuple[int, int]
HELD_OUT_SEED = 0xCA1C
HELD_OUT_POOL = 500
TRAIN_DEFAULT_SIZE = 20_000
SYSTEM = ("You are a careful assistant with a calculator. For any multiplication, call the calculator "
          "first, then give the final answer as a number.")
EXAMPLE = (("What is 417 * 23?", "417 * 23"), "9591")


def tool_call_text(expression: str) -> str:
    """A calculator call as the model writes it (the Hermes format ``agent/tool_calls.py`` parses)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def messages(problem: Problem) -> tuple[dict[str, str], ...]:
    (question, expression), result = EXAMPLE
    a, b = problem
    return ({"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"The answer is {result}."},
            {"role": "user", "content": f"What is {a} * {b}?"})


def _draw(rng: random.Random) -> Problem:
    return rng.randrange(100, 1000), rng.randrange(11, 100)


@lru_cache(maxsize=1)
def _held_out_pool() -> tuple[Problem, ...]:
    return generated.held_out_pool(_draw, HELD_OUT_SEED, HELD_OUT_POOL)


def _prompts(problems: list[Problem]) -> list[Prompt]:
    return [Prompt(index=i, messages=messages(p), answer=str(p[0] * p[1]), task="arithmetic")
            for i, p in enumerate(problems)]


def calculator_eval(seed: int = 0, size: int | None = None) -> list[Prompt]:
    """The fixed held-out problems (``seed`` is ignored: the set must not move between runs)."""
    return _prompts(generated.held_out(_held_out_pool(), 100 if size is None else size, "calculator-eval"))


def calculator_train(seed: int = 0, size: int | None = None) -> list[Prompt]:
    """``size`` problems drawn from ``seed``, none of them in the held-out pool."""
    size = TRAIN_DEFAULT_SIZE if size is None else size
    return _prompts(generated.training(_draw, _held_out_pool(), seed, size, "calculator"))
