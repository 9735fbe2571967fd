"""OpenAI messages -> prompt token ids, with the model's own chat template.

The first turn of an episode is the template's text (``apply_chat_template`` with ``tools=`` and the
generation prompt) tokenised as the data path does (``data/template.py``: no special tokens added on
top of the template's).

A later turn *extends* the previous one when the agent sent back the history it was given plus our
reply unchanged, and the template renders that history as a prefix of the new text. Its prompt is
then the previous turn's prompt and output token ids as recorded, followed by the new text after
the reply's end-of-turn marker, tokenised on its own. The reply is never re-tokenised from its
text: re-tokenising generated text can change the tokens (a different but equally valid split) and
the recorded logprobs would no longer belong to the sequence trained on. The end-of-turn marker is
the tokenizer's ``eos_token`` (``<|im_end|>`` for the ChatML templates of SmolLM2 and Qwen); a reply
cut by the token limit gets it appended as an environment token.

Otherwise (the agent edited or truncated the history, or the template renders earlier turns
differently once a new one follows, as templates that drop earlier reasoning do) the turn is
rendered from scratch and starts a new sequence; ``RenderedPrompt.extends`` says which happened.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


class RenderError(ValueError):
    """A request's messages cannot be rendered; the message names the message index and field."""


@dataclass(frozen=True)
class PreviousTurn:
    """What the next turn may extend: the messages rendered, the reply returned, and the token ids."""

    messages: tuple[Message, ...]  # normalised, as rendered
    reply: Message  # normalised assistant message we returned
    sequence: tuple[int, ...]  # prompt + output token ids, as recorded


@dataclass(frozen=True)
class RenderedPrompt:
    """A turn's prompt ids; ``extends``: they begin with the previous turn's sequence, token for token."""

    ids: list[int]
    extends: bool


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RenderError(f"{where}.content[{k}]: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RenderError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any, where: str) -> Any:
    """Templates render arguments as an object (``tojson``); OpenAI sends them as a JSON string."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # kept as the model wrote it
    if raw is None or isinstance(raw, dict):
        return raw or {}
    raise RenderError(f"{where}.arguments: expected a JSON string or object")


def normalise(messages: Sequence[Any]) -> list[Message]:
    """Messages as chat templates expect them: text content (never None), tool-call arguments as objects."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RenderError("messages: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RenderError(f"{where}: expected an object with a string 'role'")
        msg: Message = {"role": m["role"], "content": _text(m.get("content"), where)}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        calls = m.get("tool_calls") or []
        if calls:
            msg["tool_calls"] = []
            for k, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RenderError(f"{where}.tool_calls[{k}]: expected {{'function': {{'name', 'arguments'}}}}")
                msg["tool_calls"].append({"id": str(call.get("id", "")), "type": "function", "function": {
                    "name": fn["name"], "arguments": _arguments(fn.get("arguments"), f"{where}.tool_calls[{k}]")}})
        out.append(msg)
    return out


def same_reply(sent_back: Message, reply: Message) -> bool:
    """Whether the agent sent our reply back unchanged (tool-call ids aside: agents may rewrite them)."""
    def key(m: Message) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in m.get("tool_calls", []))
        return m["role"], m["content"].strip(), calls
    return key(sent_back) == key(reply)


class ChatRenderer:
    """Renders and tokenises the messages of one model (its tokenizer and chat template)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the tokenizer has no chat template; agent episodes need one")
        if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
            raise RenderError("the tokenizer has no eos_token; it marks where a reply ends")
        self.tokenizer = tokenizer
        self.eos_text: str = tokenizer.eos_token
        self.eos_id: int = int(tokenizer.eos_token_id)

    def text(self, messages: Sequence[Message], tools: list[Any] | None, generation_prompt: bool) -> str:
        """The template's text of normalised ``messages``."""
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja errors come in many types; the agent gets the message
            raise RenderError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def reply_text(self, output_ids: Sequence[int]) -> str:
        """A reply's text without its end-of-turn token and any special tokens."""
        ids = list(output_ids)
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[Message], tools: list[Any] | None,
               previous: PreviousTurn | None) -> RenderedPrompt:
        """The prompt of a turn with normalised ``messages``: extending ``previous`` where it can."""
        full = self.text(messages, tools, generation_prompt=True)
        if previous is not None:
            ids = self._extend(messages, tools, previous, full)
            if ids is not None:
                return RenderedPrompt(ids=ids, extends=True)
        return RenderedPrompt(ids=self.encode(full), extends=False)

    def _extend(self, messages: list[Message], tools: list[Any] | None, previous: PreviousTurn,
                full: str) -> list[int] | None:
        k = len(previous.messages)
        if len(messages) <= k + 1 or messages[:k] != list(previous.messages) \
                or not same_reply(messages[k], previous.reply):
            return None
        base = self.text(messages[:k + 1], tools, generation_prompt=False)
        end = base.rfind(self.eos_text)
        if not full.startswith(base) or end < 0:
            return None
        sequence = list(previous.sequence)
        if not sequence or sequence[-1] != self.eos_id:  # cut by the token limit: close the turn
            sequence.append(self.eos_id)
        return sequence + self.encode(base[end + len(self.eos_text):] + full[len(base):])
