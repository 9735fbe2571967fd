"""Text <-> token ids for ``text`` prompts and the ``text`` field of replies.

``tokenizers`` reads ``tokenizer.json`` directly, which starts in well under a second; importing
transformers would add seconds to every server start. Folders without ``tokenizer.json`` fall
back to transformers' AutoTokenizer.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


class Tokenizer:
    """``encode``/``decode`` over either a ``tokenizers`` tokenizer or a transformers one."""

    def __init__(self, impl: Any, fast: bool) -> None:
        self._impl, self._fast = impl, fast

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text. ``tokenizers`` releases the GIL in its batch call (its single call
        does not), so a long prompt tokenised on a worker thread leaves the event loop running."""
        if self._fast:
            return [list(e.ids) for e in self._impl.encode_batch(texts)]
        return [list(self._impl.encode(t)) for t in texts]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (added tokens included).

        Every token of a text stands for at most this many of its characters (byte-level
        vocabularies spell each byte as one character), so a text of more than
        ``context x max_token_chars`` characters cannot fit the context whatever it tokenizes to.
        """
        vocab = self._impl.get_vocab(with_added_tokens=True) if self._fast else self._impl.get_vocab()
        return max((len(token) for token in vocab), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._impl.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model: str | Path) -> Tokenizer | None:
    """The model folder's tokenizer (``tokenizer.json`` when present, else transformers'); None when it has none."""
    folder = Path(model)
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as FastTokenizer

        return Tokenizer(FastTokenizer.from_file(str(folder / "tokenizer.json")), fast=True)
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.model").is_file():
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(str(folder)), fast=False)
    return None
