"""Typed configuration: dataclass trees loaded from YAML with dotted ``key=value`` overrides.

Every component owns a small ``@dataclass`` of its settings next to its code; ``config.py``
assembles them into one tree. This module holds the generic machinery: building a dataclass
tree from plain data, checking types, and naming the exact key when something is wrong.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# Values that YAML aliases may add to a document by expansion. A config reuses a list or a number
# here and there; 336 bytes of anchors referencing anchors ("billion laughs") expand to 43 million
# strings, whose construction and error message took 13 s and 1.4 GB.
MAX_ALIAS_EXPANSION = 10_000
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML was built with it
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 120
_SHOWN.maxlist = _SHOWN.maxdict = 8
_SHOWN.maxlevel = 3


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


def shown(value: Any) -> str:
    """``repr(value)`` cut to a few hundred characters: an error names the key, it does not echo a
    megabyte the user (or an attacker) put there."""
    return _SHOWN.repr(value)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], path: set[int]) -> int:
    """Nodes of the tree ``node`` stands for once every alias is expanded (shared nodes counted each time
    they are referenced; each distinct node measured once). A node that contains itself raises."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in path:
        raise ConfigError("a YAML alias refers to a node that contains it (a recursive alias)")
    path.add(key)
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, sizes, path) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, sizes, path) + _expanded_size(v, sizes, path) for k, v in node.value)
    else:
        size = 1
    path.discard(key)
    sizes[key] = size
    return size


def safe_yaml(text: str) -> Any:
    """``yaml.safe_load``, refusing aliases that would grow the document by more than
    ``MAX_ALIAS_EXPANSION`` values (or refer to themselves) before anything is constructed."""
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}
        expanded = _expanded_size(node, sizes, set())
        if expanded - len(sizes) > MAX_ALIAS_EXPANSION:
            raise ConfigError(f"YAML aliases expand {len(sizes)} values to {expanded}; at most "
                              f"{MAX_ALIAS_EXPANSION} more are allowed")
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError("YAML nested too deeply") from None
    finally:
        loader.dispose()


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name[:200], valid, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(sorted(valid))})"


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {shown(value)} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {shown(value)}")
        inner = args[0] if args else Any
        items = [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section, got {shown(value)}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads ``1e-5`` (no dot) as a string; users mean the number
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        if not math.isfinite(value):  # no setting means "unbounded" by .inf, and .nan passes no comparison
            raise ConfigError(f"{key}: must be a finite number, got {shown(value)}")
        return float(value)
    if tp is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {shown(value)}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError."""
    types_ = _field_types(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in types_:
            raise ConfigError(f"unknown key '{_cut(key)}'{_suggest(name, list(types_))}")
        kwargs[name] = _convert(value, types_[name], key)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{prefix}.{e}" if prefix else str(e)) from None
    return obj


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {shown(text)} must look like key.sub=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {shown(text)} has an empty key part")
    try:
        return path, safe_yaml(raw) if raw.strip() else ""
    except ConfigError as e:
        raise ConfigError(f"{_cut(key.strip())}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{_cut(key.strip())}: invalid YAML value: {str(e)[:500]}") from None


def apply_overrides(cls: type, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted overrides into ``data``, checking each key against the dataclass tree."""
    for text in overrides:
        path, value = parse_override(text)
        node, node_cls = data, cls
        for i, part in enumerate(path):
            types_ = _field_types(node_cls)
            dotted = ".".join(path[: i + 1])
            if part not in types_:
                raise ConfigError(f"unknown key '{_cut(dotted)}'{_suggest(part, list(types_))}")
            if i == len(path) - 1:
                node[part] = value
            else:
                sub = types_[part]
                if not dataclasses.is_dataclass(sub):
                    raise ConfigError(f"'{_cut(dotted)}' is a value, not a section")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"'{_cut(dotted)}' must be a section")
                node_cls = sub
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = safe_yaml(path.read_text()) or {}
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {str(e)[:500]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def directory_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be (or become) a directory - it, or a folder above it, is a file - else None.
    Checked at load so a run fails before it starts, not at its first write."""
    path = Path(path).expanduser()
    for part in (path, *path.parents):
        if part.is_dir():
            return None
        if part.exists() or part.is_symlink():
            what = "is" if part == path else f"is inside {part}, which is"
            return f"{shown(str(path))} {what} not a directory"
    return None


def require(cond: bool, key: str, message: str) -> None:
    """Raise ConfigError naming ``key`` unless ``cond``; for ``validate()`` methods."""
    if not cond:
        raise ConfigError(f"{key}: {message}")
