"""One async client for SGLang and the embedded server (they speak the same HTTP protocol).

Differences between SGLang releases are handled here and nowhere else:
- ``/get_weight_version`` is 404 from 0.5.9 on: fall back to ``/model_info``.
- ``/pause_generation`` takes a ``mode`` from 0.5.9 on; 0.5.2 takes no body and always aborts.
- 0.5.23 requires ``/begin_weight_update`` ... ``/end_weight_update`` around distributed updates;
  older servers answer 404 to them, which is harmless.
- ``/get_load`` (0.5.2) became ``/v1/loads`` (0.5.9).
"""
from __future__ import annotations

import base64
import binascii
import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from megatron_areal.util import run_identity

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A request to a rollout server failed; the message names the server and endpoint."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{url}{endpoint}: {message}")
        self.url, self.endpoint, self.status = url, endpoint, status


@dataclass
class GenerateResult:
    """One ``/generate`` answer: the output tokens with their logprobs and the weight version of each, why it
    finished, and the token counts."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    output_versions: list[str] = field(default_factory=list)  # per output token
    meta_info: dict[str, Any] = field(default_factory=dict)
    # ``meta_info.routed_experts`` decoded: int32 (positions, layers, top_k) in C order, the bytes
    # SGLang base64-encodes; None when the server sent none.
    routed_experts: bytes | None = None

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> GenerateResult:
        """Parse SGLang's JSON answer (its ``meta_info``), tolerating the fields older versions lack.

        Raises ``MalformedReply`` for what no correct server sends: a field of the wrong type, a token
        id that is not an integer, a logprob that is null, not a number or not finite.
        """
        try:
            return cls._parse(body)
        except MalformedReply:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise MalformedReply(f"malformed reply: {type(e).__name__}: {e}") from None

    @classmethod
    def _parse(cls, body: dict[str, Any]) -> GenerateResult:
        meta = _object(body.get("meta_info") or {}, "meta_info")
        ids = [_token(t) for t in _array(body.get("output_ids") or [], "output_ids")]
        logprobs = [_logprob(e) for e in _array(meta.get("output_token_logprobs") or [], "output_token_logprobs")]
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type", "abort") if isinstance(reason, dict) else str(reason)
        version = str(meta.get("weight_version", "default"))
        return cls(output_ids=ids, output_logprobs=logprobs, finish_reason=kind, weight_version=version,
                   prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
                   completion_tokens=int(meta.get("completion_tokens", len(ids)) or 0),
                   output_versions=_versions_per_token(meta, len(ids), version), meta_info=meta,
                   routed_experts=_routes_bytes(meta))


class MalformedReply(ValueError):
    """A reply no correct server sends; the client raises it as that server's ``ServerError``."""


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedReply(f"malformed reply: {name} is {type(value).__name__}, not an object")
    return value


def _array(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedReply(f"malformed reply: {name} is {type(value).__name__}, not an array")
    return value


def _token(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedReply(f"malformed reply: output_ids holds {value!r}, not a token id")
    return value


def _logprob(entry: Any) -> float:
    """The logprob of one ``[logprob, token id, text]`` entry: a finite number."""
    value = entry[0] if isinstance(entry, (list, tuple)) and entry else entry
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedReply(f"malformed reply: output_token_logprobs holds {value!r}, not a finite logprob")
    return float(value)


def _routes_bytes(meta: dict[str, Any]) -> bytes | None:
    text = meta.get("routed_experts")
    if text is None:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise ValueError(f"meta_info.routed_experts is not base64: {e}") from None
    if len(raw) % 4:
        raise ValueError(f"meta_info.routed_experts: {len(raw)} bytes is not a whole number of int32 values")
    return raw


def _versions_per_token(meta: dict[str, Any], n: int, version: str) -> list[str]:
    """Expand 0.5.23's ``weight_versions`` spans; older servers report one version per request."""
    spans = meta.get("weight_versions")
    out = [version] * n
    if isinstance(spans, list):
        for span in spans:
            for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
                out[i] = str(span["version"])
    return out


class RolloutClient:
    """Talks to one server. Create inside a running event loop; close with ``await close()``."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 control_timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        if "://" not in self.url:
            self.url = "http://" + self.url
        self.timeout_s, self.control_timeout_s = timeout_s, control_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(headers=headers,
                                              connector=aiohttp.TCPConnector(limit=0, force_close=False))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._session.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- HTTP plumbing -------------------------------------------------------------------
    async def request(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                       timeout_s: float | None = None, ok404: bool = False) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)
        try:
            async with self._session.request(method, self.url + endpoint, json=body, timeout=timeout) as r:
                text = await r.text()
                if r.status == 404 and ok404:
                    return None
                if r.status >= 400:
                    raise ServerError(self.url, endpoint, f"HTTP {r.status}: {text[:500]}", r.status)
                if r.content_type == "application/json" and text:
                    try:
                        return await r.json(content_type=None)
                    except ValueError as e:
                        raise ServerError(self.url, endpoint, f"malformed JSON reply: {e}") from None
                return text
        except TimeoutError:
            raise ServerError(self.url, endpoint, f"no reply within {timeout.total:.0f}s") from None
        except aiohttp.ClientError as e:
            raise ServerError(self.url, endpoint, f"{type(e).__name__}: {e}") from None

    async def control(self, endpoint: str, body: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> dict[str, Any]:
        """POST a control call; a ``success: false`` reply is raised as an error."""
        reply = await self.request("POST", endpoint, body or {}, timeout_s)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise ServerError(self.url, endpoint, str(reply.get("message", "refused")))
        return reply if isinstance(reply, dict) else {"message": reply}

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       rid: str | None = None, *, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0, lora_path: str | None = None) -> GenerateResult:
        """One ``/generate``. ``return_routed_experts`` asks a MoE server for the experts of each
        position from ``routed_experts_start_len`` to the last but one token (SGLang needs
        ``--enable-return-routed-experts`` for it). ``lora_path``: the name of a LoRA adapter the server
        loaded (SGLang's field; ``/load_lora_adapter``) to generate with."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                "return_logprob": True}
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        if return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        reply = await self.request("POST", "/generate", body, timeout_s=self.timeout_s)
        if not isinstance(reply, dict):
            raise ServerError(self.url, "/generate", f"expected one JSON object, got {str(reply)[:200]}")
        try:
            result = GenerateResult.from_response(reply)
        except ValueError as e:  # MalformedReply, or routed experts that are not base64
            raise ServerError(self.url, "/generate", str(e)) from None
        if len(result.output_logprobs) != len(result.output_ids):
            raise ServerError(self.url, "/generate", f"malformed reply: {len(result.output_ids)} tokens but "
                              f"{len(result.output_logprobs)} logprobs (return_logprob was asked for)")
        return result

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation; in ``abort`` mode running requests return with what they have. The first call of
        every weight push: the server must prove it is still this run's (``require_ours``)."""
        await self.require_ours("/pause_generation")
        try:
            await self.request("POST", "/pause_generation", {"mode": mode})
        except ServerError as e:
            if e.status not in (400, 422) or mode != "abort":
                raise
            await self.request("POST", "/pause_generation")  # 0.5.2: no body, always aborts

    async def resume(self) -> None:
        """``/continue_generation``."""
        await self.request("POST", "/continue_generation", {})

    async def abort_all(self) -> None:
        """Abort every request on the server (``/abort_request`` with ``abort_all``)."""
        await self.request("POST", "/abort_request", {"abort_all": True})

    async def abort(self, rid: str) -> None:
        """Abort the request ``rid``."""
        await self.request("POST", "/abort_request", {"rid": rid})

    async def flush_cache(self) -> None:
        """``/flush_cache``: drop the server's prefix cache."""
        await self.request("POST", "/flush_cache")

    async def is_ours(self, timeout_s: float = 5.0) -> bool:
        """Whether the server proves it holds this run's nonce (``util/run_identity.py``); True outside a launched run.
        Asked without the API key, before any keyed request: a restarted server's port may now be another
        process's, which must get neither our requests nor our key."""
        nonce = run_identity.run_nonce()
        if not nonce:
            return True
        challenge = secrets.token_hex(16)
        try:
            async with aiohttp.ClientSession() as plain, plain.get(
                    self.url + run_identity.ROUTE, params={"challenge": challenge},
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                problem = run_identity.check_reply(nonce, challenge, r.status, await r.content.read(4096))
        except (TimeoutError, aiohttp.ClientError) as e:
            problem = f"does not answer {run_identity.ROUTE} ({type(e).__name__})"
        if problem is not None:
            log.warning("server %s %s: not a server this run started; not admitted", self.url, problem)
        return problem is None

    async def require_ours(self, endpoint: str) -> None:
        """Raise ``ServerError`` unless the server proves it is this run's: a server that died since it was
        admitted may have left its port to another process, which must not get our weights or our key."""
        if not await self.is_ours():
            raise ServerError(self.url, endpoint, "not a server this run started (no proof of the run's nonce)")

    async def alive(self, timeout_s: float = 5.0) -> bool:
        """Liveness without generating: ``/model_info`` answers while paused and during updates,
        where SGLang's ``/health`` (a one-token generation) waits and then says 503. Only a server of this
        run counts (``is_ours``)."""
        if not await self.is_ours(timeout_s):
            return False
        try:
            await self.request("GET", "/model_info", timeout_s=timeout_s)
            return True
        except ServerError:
            return False

    async def health(self, timeout_s: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 (SGLang generates a token for it: it waits while paused), from a
        server of this run (``is_ours``)."""
        if not await self.is_ours(timeout_s):
            return False
        try:
            await self.request("GET", "/health", timeout_s=timeout_s)
            return True
        except ServerError:
            return False

    async def load(self) -> int:
        """Running + waiting requests, for least-loaded routing."""
        reply = await self.request("GET", "/v1/loads", ok404=True)
        if reply is None:
            reply = await self.request("GET", "/get_load")
            items = reply if isinstance(reply, list) else [reply]
            return sum(int(x.get("num_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in items)
        return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                   for x in reply.get("loads", []))

    async def weight_version(self) -> str:
        """The weight version the server holds (``/get_weight_version``, else ``/model_info``)."""
        reply = await self.request("GET", "/get_weight_version", ok404=True)
        if reply is None:
            reply = await self.request("GET", "/model_info")
        return str(reply["weight_version"])

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` (``/get_model_info`` on older SGLang)."""
        reply = await self.request("GET", "/model_info", ok404=True)
        return reply if reply is not None else await self.request("GET", "/get_model_info")
