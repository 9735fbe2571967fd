"""Chat rendering of multi-turn episodes, checked against transformers' ``apply_chat_template``.

A later turn's prompt is the earlier turns' recorded token ids followed by the new messages
(``agent/render.py``). Where the model's reply is exactly what the template renders for the
assistant message, the spliced prompt must decode to, and tokenise as, the template's own text of
the whole conversation. Templates: the tiny test models', SmolLM2-135M-Instruct's, and a Qwen-style
template with ``tools`` and ``<tool_call>`` blocks (written here in the Hermes format Qwen uses).
"""
from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from megatron_areal.agent.render import ChatRenderer, PreviousTurn, normalise
from megatron_areal.agent.tool_calls import assistant_message, parse_reply

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Signatures in <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "Reply with <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call> to call one.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like templates that show earlier reasoning only in the last assistant turn (Qwen3's <think> handling).
DROPS_REASONING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@functools.cache
def tokenizer(kind: str, smollm2_dir: Any) -> Any:
    from transformers import AutoTokenizer

    from megatron_areal.model.assets import tiny_tokenizer
    if kind == "tiny":
        return tiny_tokenizer()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    if kind == "qwen-style":
        tok.chat_template = QWEN_STYLE
    elif kind == "drops-reasoning":
        tok.chat_template = DROPS_REASONING
    return tok


def canonical_reply(tok: Any, messages: list[dict], reply: dict, tools: list | None) -> list[int]:
    """The token ids of the reply exactly as the template renders it, through its end-of-turn token."""
    before = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template(messages + [reply], tools=tools, tokenize=False)
    assert after.startswith(before)
    body = after[len(before):]
    return tok(body[:body.rindex(tok.eos_token) + len(tok.eos_token)], add_special_tokens=False)["input_ids"]


def run_conversation(tok: Any, replies: list[dict], tools: list | None) -> list[tuple[list[dict], Any]]:
    """An agent's conversation: system, user, then per reply the model's turn and a tool result (or a user
    message). Returns, per turn, the messages sent and the rendered prompt."""
    renderer = ChatRenderer(tok)
    messages: list[dict] = [{"role": "system", "content": "You add numbers. Use the calculator."},
                            {"role": "user", "content": "What is 1234 * 5678?"}]
    previous, out = None, []
    for k, wanted in enumerate(replies):
        sent = normalise(messages)
        prompt = renderer.render(sent, tools, previous)
        out.append((json.loads(json.dumps(messages)), prompt))
        output = canonical_reply(tok, sent, wanted, tools)
        returned = assistant_message(parse_reply(renderer.reply_text(output)), f"call_{k}")
        previous = PreviousTurn(messages=tuple(sent), reply=normalise([returned])[0],
                                sequence=tuple(prompt.ids + output))
        messages.append(returned)  # what an OpenAI agent appends: the message it was given
        if returned.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": returned["tool_calls"][0]["id"], "content": "7006652"})
        else:
            messages.append({"role": "user", "content": "Are you sure? Check once more."})
    return out


TOOL_REPLY = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "x", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 5678"}}}]}
TEXT_REPLY = {"role": "assistant", "content": "1234 * 5678 = 7006652."}


@pytest.mark.parametrize("kind", ["tiny", "smollm2", "qwen-style"])
def test_spliced_turns_equal_the_template_of_the_whole_conversation(kind: str, smollm2) -> None:
    tok = tokenizer(kind, smollm2)
    tools = [CALCULATOR] if kind == "qwen-style" else None
    replies = [TOOL_REPLY, TEXT_REPLY, TEXT_REPLY] if kind == "qwen-style" else [TEXT_REPLY, TEXT_REPLY, TEXT_REPLY]
    turns = run_conversation(tok, replies, tools)
    for k, (messages, prompt) in enumerate(turns):
        reference = tok.apply_chat_template(normalise(messages), tools=tools, tokenize=False,
                                            add_generation_prompt=True)
        assert prompt.extends == (k > 0), f"turn {k}"
        assert tok.decode(prompt.ids, skip_special_tokens=False) == reference, f"turn {k}"
        assert prompt.ids == tok(reference, add_special_tokens=False)["input_ids"], f"turn {k}"
    if kind == "qwen-style":  # the reference really holds the tool call, the tool list and the result
        final = tok.decode(turns[-1][1].ids)
        assert '"arguments": {"expression": "1234 * 5678"}' in final and "<tools>" in final
        assert "<tool_response>\n7006652\n</tool_response>" in final


def test_a_tool_call_the_template_cannot_show_is_kept_as_the_model_wrote_it(smollm2) -> None:
    """SmolLM2's template renders only ``content``: re-rendering would erase the model's tool call from its
    own history; the recorded ids keep it, and the rest is the template's text."""
    tok = tokenizer("smollm2", smollm2)
    renderer = ChatRenderer(tok)
    messages = normalise([{"role": "user", "content": "What is 1234 * 5678?"}])
    first = renderer.render(messages, [CALCULATOR], None)
    raw = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
    output = tok(raw + tok.eos_token, add_special_tokens=False)["input_ids"]
    returned = assistant_message(parse_reply(renderer.reply_text(output)), "call_0")
    assert returned["content"] == "" and returned["tool_calls"][0]["function"]["name"] == "calculator"
    history = messages + normalise([returned, {"role": "tool", "tool_call_id": "call_0_0", "content": "7006652"}])
    previous = PreviousTurn(messages=tuple(messages), reply=normalise([returned])[0],
                            sequence=tuple(first.ids + output))
    second = renderer.render(history, [CALCULATOR], previous)
    assert second.extends and second.ids[:len(first.ids) + len(output)] == first.ids + output
    as_written = history[:1] + [{"role": "assistant", "content": raw}] + history[2:]
    assert tok.decode(second.ids) == tok.apply_chat_template(as_written, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("change", ["edited reply", "truncated history", "template drops reasoning"])
def test_a_turn_that_does_not_extend_is_rendered_from_scratch(change: str, smollm2) -> None:
    tok = tokenizer("drops-reasoning" if change == "template drops reasoning" else "smollm2", smollm2)
    renderer = ChatRenderer(tok)
    messages = normalise([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}])
    first = renderer.render(messages, None, None)
    reply = {"role": "assistant", "content": "<think>two and two</think>4"}
    output = canonical_reply(tok, messages, reply, None)
    returned = normalise([assistant_message(parse_reply(renderer.reply_text(output)), "c")])[0]
    previous = PreviousTurn(messages=tuple(messages), reply=returned, sequence=tuple(first.ids + output))
    sent = dict(returned, content="4") if change == "edited reply" else returned
    history = messages + [sent, {"role": "user", "content": "And 3 + 3?"}]
    if change == "truncated history":
        history = history[1:]
    second = renderer.render(history, None, previous)
    reference = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert not second.extends
    assert second.ids == tok(reference, add_special_tokens=False)["input_ids"]


def test_a_reply_cut_by_the_token_limit_is_closed_with_the_end_of_turn_token(smollm2) -> None:
    tok = tokenizer("smollm2", smollm2)
    renderer = ChatRenderer(tok)
    messages = normalise([{"role": "user", "content": "Count to ten."}])
    first = renderer.render(messages, None, None)
    output = tok("1, 2, 3, 4", add_special_tokens=False)["input_ids"]  # no <|im_end|>: finish_reason length
    returned = normalise([assistant_message(parse_reply(renderer.reply_text(output)), "c")])[0]
    previous = PreviousTurn(messages=tuple(messages), reply=returned, sequence=tuple(first.ids + output))
    second = renderer.render(messages + [returned, {"role": "user", "content": "Go on."}], None, previous)
    n = len(first.ids) + len(output)
    assert second.extends and second.ids[:n] == first.ids + output and second.ids[n] == tok.eos_token_id
    reference = tok.apply_chat_template(messages + [returned, {"role": "user", "content": "Go on."}],
                                        tokenize=False, add_generation_prompt=True)
    assert tok.decode(second.ids) == reference
