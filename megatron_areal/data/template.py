"""Prompts -> token ids, through the tokenizer's own chat template."""
from __future__ import annotations

from typing import Any

from megatron_areal.data.prompt import DataError, Prompt


def encode_prompt(tokenizer: Any, prompt: Prompt, use_chat_template: bool) -> list[int]:
    """Token ids of ``prompt`` ready for generation.

    With the chat template the text ends with the assistant header (``add_generation_prompt``);
    the template already places any special tokens, so none are added on top. Without it the plain
    text is encoded as the tokenizer would for pre-training text (its BOS rule applies).
    """
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the tokenizer has no chat template; set data.chat_template=false")
        text = tokenizer.apply_chat_template(prompt.as_messages(), tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prompt.messages is not None:
        raise DataError(f"prompt {prompt.index} is a conversation; it needs data.chat_template=true")
    return list(tokenizer(prompt.text)["input_ids"])
