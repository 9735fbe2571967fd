"""Tool calls parsed from a reply, in the Hermes / Qwen format the chat templates render them in:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

A reply may hold several. Text outside the blocks is the message's content. A block that is not
valid JSON with a string ``name`` and an object ``arguments`` is a malformed call: the reply then
goes back to the agent as plain text (content, no ``tool_calls``), so the agent sees exactly what
the model wrote and the episode goes on; it is never raised.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into content and tool calls; ``malformed`` says why calls were not taken."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: str = ""


def parse_reply(text: str) -> ParsedReply:
    """``text`` (the decoded reply, without its end-of-turn token) as content and tool calls."""
    blocks = list(TOOL_CALL.finditer(text))
    if not blocks:
        return ParsedReply(content=text.strip())
    calls = []
    for k, block in enumerate(blocks):
        call = _parse_call(block.group(1))
        if isinstance(call, str):
            return ParsedReply(content=text.strip(), malformed=f"tool call {k}: {call}")
        calls.append(call)
    content = TOOL_CALL.sub("", text).strip()
    return ParsedReply(content=content, tool_calls=tuple(calls))


def _parse_call(body: str) -> ToolCall | str:
    """The call in one block, or why it is malformed."""
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at character {e.pos})"
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    name, arguments = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "no string 'name'"
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"'arguments' must be an object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments)


def assistant_message(reply: ParsedReply, call_id_prefix: str) -> dict[str, Any]:
    """The OpenAI assistant message of a parsed reply (tool-call arguments as a JSON string, as OpenAI sends)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": f"{call_id_prefix}_{k}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for k, c in enumerate(reply.tool_calls)]
    return message
