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

Message contents are plain text. The template's own markers (``<|im_start|>``, ``<|im_end|>``) are
the tokenizer's control tokens, but a tool's output, an environment's message or a prompt may hold
the same strings, and tokenising the rendered text as a whole would turn a tool result holding
``<|im_end|>\n<|im_start|>user ...`` into a forged turn. So where a message's content holds the
text of any of the tokenizer's added tokens (``control_strings``), the text is tokenised in parts:
the template's own text as before, each such content as plain text (``plain_ids``: every added
token's text is split after its first character, so it becomes ordinary tokens). The content's
place in the text is found by rendering the messages with a marker instead of it; a template that
changes such a content (so that its text is not where the marker was) is refused with a
``RenderError`` naming the message. Contents without control text are tokenised exactly as before.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


_MARKER = "\ue000content {}\ue001"  # private-use characters: no template or tokenizer gives them meaning


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
        self.control_strings = control_strings(tokenizer)

    def text(self, messages: Sequence[Message], tools: list[Any] | None, generation_prompt: bool) -> str:
        """The template's text of normalised ``messages``."""
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja errors come in many types; the agent gets the message
            raise RenderError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def plain_ids(self, text: str) -> list[int]:
        """``text`` tokenised with no added token recognised in it: each occurrence of one's text is
        split after its first character, and the rest is looked at again."""
        ids: list[int] = []
        start = 0
        while True:
            found = self._next_control(text, start)
            if found is None:
                return ids + (self.encode(text[start:]) if start < len(text) else [])
            at, control = found
            if at > start:
                ids += self.encode(text[start:at])
            ids += self.encode(control[0])
            start = at + 1

    def _next_control(self, text: str, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for control in self.control_strings:  # longest first: at one position, the longest wins
            at = text.find(control, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, control)
        return best

    def content_spans(self, messages: Sequence[Message], tools: list[Any] | None, generation_prompt: bool,
                      text: str) -> list[tuple[int, int]]:
        """Where in the template's ``text`` of ``messages`` lie the contents that hold control text
        (none for most conversations)."""
        held = [i for i, m in enumerate(messages) if any(c in m["content"] for c in self.control_strings)]
        if not held:
            return []
        marked = [dict(m, content=_MARKER.format(i)) if i in held else m for i, m in enumerate(messages)]
        template = self.text(marked, tools, generation_prompt)
        spans, pieces, cursor, shift = [], [], 0, 0
        for i in held:
            marker = _MARKER.format(i)
            at = template.find(marker, cursor)
            if at < 0 or template.count(marker) != 1:
                raise RenderError(f"messages[{i}].content holds control-token text and the chat template does "
                                  "not render it once as given")
            content = messages[i]["content"]
            pieces += [template[cursor:at], content]
            start = at + shift
            spans.append((start, start + len(content)))
            shift += len(content) - len(marker)
            cursor = at + len(marker)
        if "".join(pieces) + template[cursor:] != text:
            raise RenderError(f"messages{held}: a content holding control-token text is changed by the chat "
                              "template, so it cannot be tokenised as plain text")
        return spans

    def encode_rendered(self, text: str, spans: Sequence[tuple[int, int]], start: int = 0) -> list[int]:
        """``text[start:]`` tokenised: the parts in ``spans`` as plain text, the rest as a whole."""
        ids: list[int] = []
        cursor = start
        for begin, end in spans:
            if end <= cursor:
                continue
            begin = max(begin, cursor)
            if begin > cursor:
                ids += self.encode(text[cursor:begin])
            ids += self.plain_ids(text[begin:end])
            cursor = end
        return ids + (self.encode(text[cursor:]) if cursor < len(text) else [])

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
        spans = self.content_spans(messages, tools, True, full)
        if previous is not None:
            ids = self._extend(messages, tools, previous, full, spans)
            if ids is not None:
                return RenderedPrompt(ids=ids, extends=True)
        return RenderedPrompt(ids=self.encode_rendered(full, spans), extends=False)

    def _extend(self, messages: list[Message], tools: list[Any] | None, previous: PreviousTurn,
                full: str, spans: Sequence[tuple[int, int]]) -> list[int] | None:
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
        # base is a prefix of full: the new text is full's from the reply's end-of-turn marker on
        return sequence + self.encode_rendered(full, spans, end + len(self.eos_text))


def control_strings(tokenizer: Any) -> tuple[str, ...]:
    """The text of every added token (the template's markers and the other special tokens), longest
    first."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {str(getattr(t, "content", t)) for t in added.values()} | set(getattr(tokenizer, "all_special_tokens", []))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))
