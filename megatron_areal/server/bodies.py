"""Request bodies of the embedded server: read under a deadline, parsed off the event loop when large,
and each field checked for its type and bounded in length.

Decoding a 15 MB JSON body takes around a second inside ``json.loads``, which holds the GIL
throughout: on the event loop, or on any thread of the server, that stalls every other request
(``/health`` included) for as long. So a body larger than ``INLINE_PARSE_BYTES`` is decoded in a
helper process (``body_decoder``), and its route's validation runs on ``ParsePool``'s threads,
whatever the body's shape.

A string a client sends may come back in a reply, once per sequence of a ``/generate`` (the
weight version) or in an error message; each is bounded here, and an error message is cut to
``MAX_MESSAGE_CHARS`` whatever it quotes.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from megatron_areal.server.body_decoder import BodyDecoder, DecodeError
from megatron_areal.server.config import MAX_VERSION_CHARS
from megatron_areal.server.protocol import BadRequest

T = TypeVar("T")
INLINE_PARSE_BYTES = 64 * 2**10  # decoded on the event loop below this (well under a millisecond)
PARSE_THREADS = 2
# The request's key for its body's size, for the route's own parse (a typed key from aiohttp 3.12).
BODY_BYTES: Any = web.RequestKey("body_bytes", int) if hasattr(web, "RequestKey") else "body_bytes"
# Strings a client sends (a weight version, MAX_VERSION_CHARS, is copied into every sequence's reply):
# names are keys of the server's state, paths can be long.
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
MAX_FIELD_CHARS = 4096  # any other string field
MAX_MESSAGE_CHARS = 2000  # an error reply's message, whatever it quotes


class SlowBody(web.HTTPRequestTimeout):
    """The client did not send its body within the server's deadline (408)."""


class ParsePool:
    """The threads that decode and validate large bodies (see the module's docstring)."""

    def __init__(self, threads: int = PARSE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="body-parse")
        self.decoder = BodyDecoder()

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def maybe(self, request: web.Request, fn: Callable[[], T], *, always: bool = False) -> T:
        """``fn()`` on a parser thread when the request's body was large (or ``always``), else inline."""
        if always or request.get(BODY_BYTES, 0) > INLINE_PARSE_BYTES:
            return await self.run(fn)
        return fn()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.decoder.close()


def decode_object(raw: bytes, optional: bool = False, decoder: BodyDecoder | None = None) -> dict[str, Any]:
    """A JSON object from a body (decoded by ``decoder``'s helper process when given); BadRequest for
    anything else."""
    if not raw.strip() and optional:
        return {}
    try:
        body = json.loads(raw) if decoder is None else decoder.decode(raw)
    except DecodeError as e:
        raise BadRequest(str(e)) from None
    except ValueError as e:  # bad syntax or encoding, an integer past Python's 4300-digit limit
        raise BadRequest(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def read_json(request: web.Request, pool: ParsePool, *, optional: bool = False,
                    timeout_s: float | None = None) -> dict[str, Any]:
    """The request's JSON object, read within ``timeout_s`` (408) and decoded off the loop when large."""
    try:  # over client_max_size: aiohttp raises 413
        raw = await asyncio.wait_for(request.read(), timeout=timeout_s)
    except TimeoutError:
        raise SlowBody(reason=f"the request body did not arrive within {timeout_s:.0f}s") from None
    request[BODY_BYTES] = len(raw)
    if len(raw) > INLINE_PARSE_BYTES:
        return await pool.run(lambda: decode_object(raw, optional, pool.decoder))
    return decode_object(raw, optional)


def field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...,
          *, max_chars: int = MAX_FIELD_CHARS) -> Any:
    """``body[key]`` of type ``kind`` (a string at most ``max_chars`` long), else ``default``; BadRequest
    naming the key when it is missing without a default or of the wrong type or length."""
    if key not in body or body[key] is None:
        if default is ...:
            raise BadRequest(f"missing field {key!r}")
        return default
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        raise BadRequest(f"{key}: wrong type {type(value).__name__}")
    if isinstance(value, str) and len(value) > max_chars:
        raise BadRequest(f"{key}: {len(value)} characters; at most {max_chars}")
    return value


def version_field(body: dict[str, Any], key: str, default: Any = ...) -> str | None:
    """A weight version (a string, or an integer as SGLang also takes), at most ``MAX_VERSION_CHARS``."""
    value = field(body, key, (str, int), default, max_chars=MAX_VERSION_CHARS)
    if value is None:
        return None
    text = str(value)
    if len(text) > MAX_VERSION_CHARS:  # a long integer
        raise BadRequest(f"{key}: {len(text)} characters; at most {MAX_VERSION_CHARS}")
    return text


def clip(message: str) -> str:
    """``message`` cut to ``MAX_MESSAGE_CHARS``, saying how much was left out."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
