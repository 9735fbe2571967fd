"""``AdminKeyMiddleware``: the API key on every route of a vLLM server, its RL control routes included.

vLLM checks ``VLLM_API_KEY`` only on ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the RL routes
that ``VLLM_SERVER_DEV_MODE=1`` adds (``/pause``, ``/resume``, ``/init_weight_transfer_engine``,
``/update_weights``, ...) answer anyone who can reach the port. vLLM's public ``--middleware`` option
takes an ASGI middleware class by import path; the launcher always passes this one (``launch/vllm.py``),
which lets everything through when no key is set. It reads the key from ``VLLM_API_KEY`` (never argv)
and answers 401 to any request but ``/health`` (the registration watcher's probe) without
``Authorization: Bearer <key>``. Plain ASGI: no vLLM or Starlette import, so the trainer's environment can test it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from megatron_areal.util import run_identity

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health", run_identity.ROUTE})

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()


class AdminKeyMiddleware:
    """401 for every request without the key, when ``VLLM_API_KEY`` is set; a pass-through otherwise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self.expected = _digest(f"Bearer {key}".encode()) if key else None

    def authorized(self, scope: Scope) -> bool:
        given = b"".join(v for k, v in scope.get("headers", ()) if k.lower() == b"authorization")
        return hmac.compare_digest(_digest(given), self.expected)

    async def __call__(self, scope: Scope, receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[Any]]) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and path == run_identity.ROUTE:  # vLLM has no such route: answered here
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            status, reply = run_identity.answer(query.get("challenge", [""])[0])
            await _send_json(send, status, reply)
            return
        guarded = (self.expected is not None and scope["type"] in ("http", "websocket")
                   and scope.get("method") != "OPTIONS"
                   and scope["path"].removeprefix(scope.get("root_path", "")) not in OPEN_PATHS)
        if guarded and not self.authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _send_json(send, 401, {"error": "Unauthorized: this server needs its API key"})
            return
        await self.app(scope, receive, send)


async def _send_json(send: Callable[..., Awaitable[Any]], status: int, reply: dict[str, str]) -> None:
    body = json.dumps(reply).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
