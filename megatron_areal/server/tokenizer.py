"""Text <-> token ids for ``text`` prompts and the ``text`` field of replies.

``tokenizers`` reads ``tokenizer.json`` directly, which starts in well under a second; importing
transformers would add seconds to every server start. Folders without ``tokenizer.json`` fall
back to transformers' AutoTokenizer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    """``encode``/``decode`` over either a ``tokenizers`` tokenizer or a transformers one."""

    def __init__(self, impl: Any, fast: bool) -> None:
        self._impl, self._fast = impl, fast

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(self._impl.encode(text).ids) if self._fast else list(self._impl.encode(text))

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
