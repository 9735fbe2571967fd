"""The calculator tool, tool-call parsing and the episode -> trajectory layout, without servers.

References: Python's own arithmetic for the calculator, hand-written replies for the parser, and
hand-laid-out token sequences for the trajectories.
"""
from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest

from megatron_areal.agent.calculator import CalculatorError, evaluate
from megatron_areal.agent.calculator_task import calculator, last_number
from megatron_areal.agent.session import Turn
from megatron_areal.agent.to_trajectories import episode_trajectories
from megatron_areal.agent.tool_calls import parse_reply


def random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return str(rng.randrange(-50, 1000))
    op = rng.choice(["+", "-", "*", "/", "//", "%"])
    return f"({random_expression(rng, depth + 1)} {op} {random_expression(rng, depth + 1)})"


def test_calculator_agrees_with_python_arithmetic() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(500):
        text = random_expression(rng)
        try:
            expected = eval(text, {"__builtins__": {}})  # the reference: Python itself, on our own input
        except ZeroDivisionError:
            with pytest.raises(CalculatorError, match="division by zero"):
                evaluate(text)
            continue
        assert evaluate(text) == expected, text
        checked += 1
    assert checked > 400


@pytest.mark.parametrize("attack", [
    "__import__('os').system('touch {marker}')", "open('{marker}', 'w')", "(1).__class__", "[1, 2][0]",
    "lambda: 1", "x + 1", "'a' * 3", "9 ** 9 ** 9", "10 ** 100", "2 ** 0.5 ** -999", "1" * 300,
    "[x for x in range(10 ** 9)]"])
def test_calculator_refuses_anything_but_bounded_arithmetic(attack: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(CalculatorError):
        evaluate(attack.format(marker=marker))
    assert not marker.exists()


@pytest.mark.parametrize("base,exponent", [(-8, 0.5), (-8, 1 / 3), (-1, 0.5), (-2.5, 1.5), (-8, 2.0), (-8, -1),
                                            (8, 0.5), (-8, 3)])
def test_powers_are_real_numbers_or_an_error(base: float, exponent: float) -> None:
    """The reference is ``math.pow``, which works on real numbers: where it has no value, neither has
    the calculator (Python's ``**`` would return a complex number)."""
    expression = f"({base!r}) ** ({exponent!r})"
    try:
        expected = math.pow(base, exponent)
    except ValueError:
        with pytest.raises(CalculatorError, match="no real value"):
            evaluate(expression)
        answer = asyncio.run(calculator({"expression": expression}))
        assert answer.startswith("error:") and "j" not in answer, answer
        return
    assert evaluate(expression) == pytest.approx(expected)


def test_the_calculator_tool_answers_errors_as_text() -> None:
    assert asyncio.run(calculator({"expression": "417 * 23"})) == "9591"
    assert asyncio.run(calculator({"expression": "1 / 4"})) == "0.25"
    assert asyncio.run(calculator({"expression": "1 / 0"})) == "error: division by zero"
    assert asyncio.run(calculator({"expr": "1"})).startswith("error: expected")
    assert last_number("So 417 * 23 = 9,591.") == "9591" and last_number("none") is None


def test_tool_calls_are_parsed_and_malformed_ones_come_back_as_text() -> None:
    two = ('Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>\n'
           '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')
    parsed = parse_reply(two)
    assert parsed.content == "Let me see." and not parsed.malformed
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("calculator", {"expression": "2 * 3"}),
                                                                   ("search", {"q": "x"})]
    for bad, why in [('<tool_call>{"name": calc}</tool_call>', "not JSON"),
                     ('<tool_call>["calculator"]</tool_call>', "JSON object"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "name"),
                     ('<tool_call>{"name": "c", "arguments": 3}</tool_call>', "object"),
                     ('<tool_call>{"name": "c", "arguments": {"a": 1', "not JSON"),  # cut off inside the call
                     ('<tool_call>{"name": "c", "arguments": {"a": 1}}', "")]:  # cut before </tool_call>: a call
        parsed = parse_reply(bad)
        if why:
            assert parsed.tool_calls == () and parsed.content == bad and why in parsed.malformed, bad
        else:
            assert parsed.tool_calls[0].arguments == {"a": 1}
    assert parse_reply("  The answer is 6.  ").content == "The answer is 6."


def turn(prompt: list[int], output: list[int], versions: list[int], extends: bool) -> Turn:
    return Turn(prompt_ids=prompt, output_ids=output, output_logprobs=[-0.1 * (k + 1) for k in range(len(output))],
                output_versions=versions, extends=extends, finish_reason="stop")


def test_turns_that_extend_each_other_are_one_sequence_with_the_environment_masked() -> None:
    t1 = turn([1, 2, 3], [10, 11], [3, 3], False)
    t2 = turn([1, 2, 3, 10, 11, 50, 51], [12], [4], True)  # 50, 51: a tool result and the template's header
    t3 = turn([1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14], [5, 5], True)
    [traj], shape = episode_trajectories([t1, t2, t3], start_version=4, reward=1.0, group_id=7, episode=0,
                                         prompt_index=3)
    assert (shape.turns, shape.trajectories, shape.extended) == (3, 1, 2)
    assert traj.input_ids == [1, 2, 3, 10, 11, 50, 51, 12, 60, 13, 14]
    assert traj.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert traj.behavior_logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.1, 0, -0.1, -0.2]
    assert traj.output_versions == [3, 3, 3, 3, 4, 4, 5, 5]  # environment tokens: the version before them
    assert traj.start_version == 3  # the oldest token, older than the version the episode started at
    assert (traj.reward, traj.group_id, traj.prompt_index, traj.episode) == (1.0, 7, 3, 0)


def test_a_turn_that_does_not_extend_starts_a_new_trajectory_with_the_same_reward() -> None:
    t1 = turn([1, 2, 3], [10, 11], [0, 0], False)
    t2 = turn([1, 2, 9, 10, 11, 50], [12], [1], False)  # re-rendered history: not our tokens
    t3 = turn([1, 2, 9, 10, 11, 50, 12, 60], [], [], True)  # generated nothing
    trajs, shape = episode_trajectories([t1, t2, t3], start_version=0, reward=0.5, group_id=1, episode=2,
                                        prompt_index=0)
    assert (shape.trajectories, shape.extended) == (2, 1)
    assert [t.input_ids for t in trajs] == [[1, 2, 3, 10, 11], [1, 2, 9, 10, 11, 50, 12, 60]]
    assert [t.loss_mask for t in trajs] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 0]]
    assert {t.reward for t in trajs} == {0.5} and [t.start_version for t in trajs] == [0, 0]
    assert [t.episode for t in trajs] == [2, 2]  # one episode: its group's advantages count it once
    with pytest.raises(ValueError, match="does not start with the previous"):
        episode_trajectories([t1, turn([1, 2, 4, 10, 11], [5], [0], True)], start_version=0, reward=0,
                             group_id=0, episode=0, prompt_index=0)
