"""JSONL datasets: one object per line with ``prompt`` and ``answer`` (``tests`` for code).

``prompt`` is a string or a list of ``{"role", "content"}`` messages; ``task`` (default
``math``) names the verifier; code records carry ``tests`` and optionally ``entry_point`` and
``answer``. Blank lines are skipped. Any malformed record raises ``DataError`` naming the file
and the line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_areal.data.prompt import DataError, Prompt

_KNOWN = {"prompt", "answer", "task", "tests", "entry_point"}


def _messages(value: list[Any], where: str) -> tuple[dict[str, str], ...]:
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: prompt[{i}] must be an object with string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise DataError(f"{where}: 'prompt' is an empty list of messages")
    return tuple(out)


def _optional_str(record: dict[str, Any], key: str, where: str) -> str | None:
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def parse_record(record: Any, index: int, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - _KNOWN
    if unknown:
        raise DataError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KNOWN)}")
    if "prompt" not in record:
        raise DataError(f"{where}: missing key 'prompt'")
    prompt = record["prompt"]
    task = _optional_str(record, "task", where) or "math"
    tests = _optional_str(record, "tests", where)
    if task == "code":
        if not tests:
            raise DataError(f"{where}: a code record needs a non-empty 'tests' string")
    elif "answer" not in record:
        raise DataError(f"{where}: missing key 'answer'")
    answer = record.get("answer")
    if task != "code" and (answer is None or isinstance(answer, (dict, list, bool))):
        raise DataError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    common = dict(index=index, answer=answer, task=task, tests=tests,
                  entry_point=_optional_str(record, "entry_point", where))
    if isinstance(prompt, str):
        return Prompt(text=prompt, **common)
    if isinstance(prompt, list):
        return Prompt(messages=_messages(prompt, where), **common)
    raise DataError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


def load_jsonl(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such dataset file")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
            prompts.append(parse_record(record, len(prompts), where))
    if not prompts:
        raise DataError(f"{path}: the dataset has no records")
    return prompts
