"""The built-in agent of the ``calculator`` task (``rollout.workflow:
megatron_areal.agent.calculator_task:run_episode``).

It offers one tool, ``calculator`` (``agent/calculator.py``: a safe evaluator, run with a timeout),
runs the tool calls the model makes, and scores the final reply: reward 1 when its last number is
the product. At most ``MAX_TOOL_ROUNDS`` rounds of calls, then the model must answer.
"""
from __future__ import annotations

import asyncio
import re
from typing import Any

from megatron_areal.agent.calculator import CalculatorError, evaluate, format_number
from megatron_areal.agent.workflow import AgentTask, EpisodeResult

MAX_TOOL_ROUNDS = 2
TOOL_TIMEOUT_S = 2.0
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * (3 + 4).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


async def calculator(arguments: Any) -> str:
    """The tool: the value of ``arguments["expression"]``, or the error as text for the model to read."""
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return "error: expected {\"expression\": \"...\"}"
    try:
        value = await asyncio.wait_for(asyncio.to_thread(evaluate, expression), TOOL_TIMEOUT_S)
    except CalculatorError as e:
        return f"error: {e}"
    except TimeoutError:
        return "error: took too long"
    return format_number(value)


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


async def run_episode(task: AgentTask, client: Any) -> EpisodeResult:
    """Ask, run the calculator calls, ask again; reward 1 if the final answer is right."""
    import json

    messages = list(task.messages)
    used = 0
    for _ in range(MAX_TOOL_ROUNDS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            used += 1
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            result = await calculator(arguments) if call.function.name == "calculator" \
                else f"error: no tool named {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = messages[-1].get("content") if messages[-1].get("role") == "assistant" else ""
    correct = last_number(final or "") == str(task.answer)
    return EpisodeResult(reward=float(correct), info={"tool_used": float(used > 0)})
