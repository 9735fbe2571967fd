"""HTTP routes of the embedded server: SGLang's native API on top of the engine."""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from megatron_areal.server.connections import ConnectionGuard, ConnectionLimits
from megatron_areal.server.engine import Engine, QueueFull
from megatron_areal.server.protocol import BadRequest, Limits, parse_generate, response
from megatron_areal.server.scheduler import Request
from megatron_areal.server.weight_queue import WeightQueue
from megatron_areal.server.weights import WeightError, parse_dtype

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/health_generate", "/ready", "/metrics"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _refused(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


class SlowBody(web.HTTPRequestTimeout):
    """The client did not send its body within the server's deadline (408)."""


async def _json(request: web.Request, optional: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
    try:  # over client_max_size: aiohttp raises 413
        raw = await asyncio.wait_for(request.read(), timeout=timeout_s)
    except TimeoutError:
        raise SlowBody(reason=f"the request body did not arrive within {timeout_s:.0f}s") from None
    if not raw.strip() and optional:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:  # bad syntax or encoding, an integer past Python's 4300-digit limit
        raise BadRequest(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in body or body[key] is None:
        if default is ...:
            raise BadRequest(f"missing field {key!r}")
        return default
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                 else (kind,))):
        raise BadRequest(f"{key}: wrong type {type(value).__name__}")
    return value


class Api:
    """SGLang's native HTTP API over one ``Engine``: routes, the API key, body validation (a 4xx
    naming the field), pause/continue, and the weight endpoints."""

    def __init__(self, engine: Engine, *, api_key: str | None, tokenizer: Any, served_model_name: str,
                 connections: ConnectionGuard | None = None) -> None:
        self.engine, self.api_key, self.tokenizer = engine, api_key, tokenizer
        self.served_model_name = served_model_name
        self.connections = connections or ConnectionGuard(ConnectionLimits())
        self.limits = Limits(max_len=engine.max_len, max_requests=engine.opts.max_queue,
                             max_request_tokens=engine.opts.max_request_tokens,
                             max_text_chars=None if tokenizer is None else engine.max_len * tokenizer.max_token_chars)
        # ``running`` mirrors ``engine.paused`` for waiters; pause and continue change both under
        # ``_control`` (FIFO), so they take effect one at a time in arrival order and never disagree.
        self.running = asyncio.Event()
        self.running.set()
        self._control = asyncio.Lock()
        self.in_flight: set[str] = set()
        # Every weight operation (join, destroy, begin/end, updates from the trainer or disk) runs
        # on this one thread in arrival order, as SGLang's scheduler runs them: collectives on one
        # group follow the trainer's order, no two groups receive at once, and a join that hangs
        # never occupies the threads that pause, continue and abort use.
        self.weights = WeightQueue()

    def app(self, max_body_bytes: int) -> web.Application:
        """The aiohttp application with SGLang's routes, the API-key middleware and the body size limit."""
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._middleware])
        r = app.router
        r.add_route("*", "/generate", self.generate)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/abort_request", self.abort)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/update_weight_version", self.update_weight_version)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.models)
        r.add_get("/weights_checksum", self.weights_checksum)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/update_weights_from_shards", self.update_shards)
        r.add_post("/update_weights_from_disk", self.update_disk)
        r.add_post("/update_weights_from_tensor", self.update_tensor)
        r.add_post("/begin_weight_update", self.begin_update)
        r.add_post("/end_weight_update", self.end_update)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        self.connections.started(transport)
        try:
            return await self._handle(request, handler)
        finally:
            self.connections.finished(transport)

    async def _handle(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key and request.path not in OPEN_PATHS and not self._authorized(request):
            # Refused before the body is read, and the connection is closed rather than drained.
            refused = web.json_response({"error": "Unauthorized"}, status=401)
            refused.force_close()
            return refused
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(400, str(e))
        except WeightError as e:
            return _refused(str(e))
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.status, e.reason or e.text or "error")
            raise

    def _authorized(self, request: web.Request) -> bool:
        # aiohttp decodes header bytes that are not UTF-8 as lone surrogates; encode them back as
        # they came, so that such a key is simply a wrong key (401), not an encoding error (500).
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())

    async def _body(self, request: web.Request, optional: bool = False) -> dict[str, Any]:
        return await _json(request, optional, timeout_s=self.connections.limits.body_timeout_s)

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        """``/generate``: one prompt or a batch; answers when every sample finished, and aborts them if the
        client goes away."""
        body = await self._body(request)
        e = self.engine
        parse = functools.partial(parse_generate, body, tokenizer=self.tokenizer, vocab=e.arch.vocab_size,
                                  limits=self.limits)
        # Tokenising runs on a worker thread (the tokenizer releases the GIL), so a long prompt does not
        # hold up the event loop; token ids are checked inline.
        parsed = await asyncio.to_thread(parse) if isinstance(body, dict) and "text" in body else parse()
        if not e.has_room(parsed.count):  # before n fans out into one entry per sequence
            return _error(503, f"queue full: {parsed.count} sequences do not fit (limit {e.opts.max_queue})")
        prompts = parsed.expand()
        rids = [rid for rid, _, _ in prompts]
        if len(set(rids)) != len(rids) or self.in_flight.intersection(rids):
            raise BadRequest("rid: a request with this id is already in flight")
        await self.running.wait()  # paused: wait until /continue_generation
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[Request]] = {rid: loop.create_future() for rid in rids}

        def on_finish(req: Request) -> None:  # called on the model-runner thread
            req.finished_at = time.monotonic()
            loop.call_soon_threadsafe(_resolve, futures[req.rid], req)

        try:
            e.submit(prompts, on_finish, record_routes=parsed.return_routed_experts)
        except QueueFull as err:
            return _error(503, str(err))
        self.in_flight.update(rids)
        try:
            await self._wait_or_abort(request, list(futures.values()), rids)
        finally:
            self.in_flight.difference_update(rids)
        done = [f.result() for f in futures.values()]
        failed = next((r for r in done if _error_status(r)), None)
        if failed is not None:  # the model failed on it: an error, not a partial answer
            return _error(_error_status(failed), failed.finish_reason["message"])
        out = [response(r, return_logprob=parsed.return_logprob, weight_version=e.weight_version,
                        tokenizer=self.tokenizer, routed_experts_start_len=parsed.routed_experts_start_len)
               for r in done]
        return web.json_response(out[0] if parsed.single else out)

    async def _wait_or_abort(self, request: web.Request, futures: list[asyncio.Future[Request]],
                             rids: list[str]) -> None:
        """Wait for the outputs; if the client goes away meanwhile, abort its requests (as SGLang does)."""
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            transport = request.transport
            if pending and (transport is None or transport.is_closing()):
                log.info("client of %s disconnected: aborting", rids[0])
                await asyncio.to_thread(self.engine.abort, rids)
                await asyncio.wait(pending)

    async def health(self, request: web.Request) -> web.Response:
        """``/health``, ``/health_generate`` (wait while paused, as SGLang's one-token generation does) and
        ``/ready`` (503 while paused); 503 also when the model cannot step."""
        if request.path == "/ready" and self.engine.paused:
            return web.Response(status=503)
        if request.path != "/ready" and not await self._generation_resumes():
            return web.Response(status=503, text="generation is paused")
        if self.engine.paused:  # never 200 while the engine would not step a request
            return web.Response(status=503, text="the engine is paused")
        ok, why = self.engine.health()  # 503 also when the runner is alive but cannot step
        return web.Response(status=200) if ok else web.Response(status=503, text=why)

    async def _generation_resumes(self) -> bool:
        """SGLang's /health generates one token, so while paused it waits; 503 after the health timeout.

        Liveness during a weight update is ``/model_info``, which always answers.
        """
        try:
            await asyncio.wait_for(self.running.wait(), timeout=self.engine.opts.health_timeout_s)
        except TimeoutError:
            return False
        return True

    # ---- control -------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        """``/pause_generation``: ``abort`` returns running requests with their tokens so far, ``retract``
        re-queues them, ``in_place`` keeps them in their slots."""
        body = await self._body(request, optional=True)
        mode = _field(body, "mode", str, "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: {mode!r} is not abort, retract or in_place")
        async with self._control:
            self.running.clear()
            await asyncio.to_thread(self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        """``/continue_generation``."""
        await self._body(request, optional=True)
        async with self._control:
            await asyncio.to_thread(self.engine.resume)
            self.running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        """``/abort_request``: one request by ``rid``, or all with ``abort_all``."""
        body = await self._body(request, optional=True)
        abort_all = _field(body, "abort_all", bool, False)
        rid = _field(body, "rid", str, "")
        if abort_all or rid:
            await asyncio.to_thread(self.engine.abort, None if abort_all else rid)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: 400 while requests run or wait, as SGLang answers."""
        if await asyncio.to_thread(self.engine.flush_cache):
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: requests are running or queued.\n")

    async def begin_update(self, request: web.Request) -> web.Response:
        """Open the session that distributed and tensor updates need (SGLang 0.5.23); one at a time."""
        body = await self._body(request, optional=True)
        _field(body, "selector", str, "all")
        await self.weights.run(self.engine.begin_weight_update)
        return web.json_response({"success": True, "message": "Success"})

    async def end_update(self, request: web.Request) -> web.Response:
        """Close the session ``begin_update`` opened."""
        await self._body(request, optional=True)
        await self.weights.run(self.engine.end_weight_update)
        return web.json_response({"success": True, "message": "Success"})

    # ---- info ----------------------------------------------------------------------------
    async def get_weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version``."""
        return web.json_response({"weight_version": self.engine.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version``: rename the held weights (aborting requests unless told not to)."""
        body = await self._body(request)
        version = _field(body, "new_version", (str, int))
        if _field(body, "abort_all_requests", bool, True):
            await asyncio.to_thread(self.engine.abort, None)
        self.engine.weight_version = str(version)
        return web.json_response({"success": True, "message": f"weight version {version}"})

    async def model_info(self, request: web.Request) -> web.Response:
        """``/model_info``: model path, architecture, weight version and context length; answers while
        paused and during updates."""
        e = self.engine
        return web.json_response({
            "model_path": e.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": e.model_path if self.tokenizer is not None else None, "is_generation": True,
            "weight_version": e.weight_version, "architectures": [_architecture(e.arch.model_type)],
            "context_length": e.max_len, "load_format": "safetensors"})

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads``: running and waiting requests, for least-loaded routing."""
        running, waiting = self.engine.load()
        usage = running / self.engine.cache.num_slots
        return web.json_response({"timestamp": time.time(), "version": "megatron-areal", "loads": [
            {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "token_usage": usage}]})

    async def models(self, request: web.Request) -> web.Response:
        """``/v1/models``: the served model and its context length."""
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "owned_by": "megatron-areal",
            "max_model_len": self.engine.max_len}]})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """Per-tensor sha256 (optionally after ``?dtype=bfloat16``), to compare weights bitwise."""
        name = request.query.get("dtype")
        try:
            dtype = parse_dtype(name) if name else None
        except WeightError as err:
            raise BadRequest(str(err)) from None
        sums = await asyncio.to_thread(self.engine.checksums, dtype)
        return web.json_response({"weight_version": self.engine.weight_version, "checksums": sums})

    # ---- weights -------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group``: join the trainer's group (on the weight thread, in arrival order)."""
        b = await self._body(request)
        await self.weights.run(
            self.engine.init_group, master_address=_field(b, "master_address", str),
            master_port=_field(b, "master_port", int), rank_offset=_field(b, "rank_offset", int),
            world_size=_field(b, "world_size", int),
            group_name=_field(b, "group_name", str, "weight_update_group"),
            backend=_field(b, "backend", str, "nccl" if self.engine.device.type == "cuda" else "gloo"),
            timeout_s=self._join_timeout(b))
        return web.json_response({"success": True, "message": "joined the weight update group"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group``."""
        b = await self._body(request, optional=True)
        await self.weights.run(self.engine.destroy_group, _field(b, "group_name", str, "weight_update_group"))
        return web.json_response({"success": True, "message": "destroyed"})

    async def update_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed``: receive one bucket of tensors by broadcast from the
        trainer and install it."""
        b = await self._body(request)
        names, dtypes, shapes = _field(b, "names", list), _field(b, "dtypes", list), _field(b, "shapes", list)
        if not (len(names) == len(dtypes) == len(shapes)) or not all(isinstance(n, str) for n in names) \
                or not all(isinstance(s, list) for s in shapes):
            raise BadRequest("names, dtypes and shapes must be lists of equal length")
        load_format = _field(b, "load_format", str, "")
        if load_format not in ("", "flattened_bucket"):
            raise BadRequest(f"load_format {load_format!r} is not supported")
        version = _field(b, "weight_version", (str, int), None)
        if _field(b, "abort_all_requests", bool, False):
            await asyncio.to_thread(self.engine.abort, None)
        await self.weights.run(
            self.engine.update_from_distributed, names=names, dtypes=dtypes, shapes=shapes,
            group_name=_field(b, "group_name", str, "weight_update_group"),
            version=None if version is None else str(version), flattened=load_format == "flattened_bucket")
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors"})

    async def update_shards(self, request: web.Request) -> web.Response:
        """``/update_weights_from_shards`` (ours): receive slices from the trainer ranks that hold them, as the
        manifest lists, point to point over the group, and install the assembled tensors (``weights/wire.py``)."""
        b = await self._body(request)
        version = _field(b, "weight_version", (str, int), None)
        count = await self.weights.run(
            self.engine.update_from_shards, manifest=_field(b, "manifest", dict), senders=_field(b, "senders", int),
            group_name=_field(b, "group_name", str, "weight_update_group"),
            version=None if version is None else str(version), timeout_s=self._join_timeout(b))
        return web.json_response({"success": True, "message": f"updated {count} tensors"})

    async def update_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk``: load the whole model from a folder."""
        b = await self._body(request)
        path = _field(b, "model_path", str)
        version = _field(b, "weight_version", (str, int), None)
        if _field(b, "abort_all_requests", bool, False):
            await asyncio.to_thread(self.engine.abort, None)
        await self.weights.run(self.engine.update_from_disk, path, None if version is None else str(version))
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    async def update_tensor(self, request: web.Request) -> web.Response:
        """``/update_weights_from_tensor``: refused (it needs CUDA IPC on one node)."""
        await self._body(request, optional=True)
        await self.weights.run(self.engine.require_update_session, "update_weights_from_tensor")
        return _refused("update_weights_from_tensor needs CUDA IPC on one node; use "
                        "/update_weights_from_distributed")

    def _join_timeout(self, body: dict[str, Any]) -> float:
        """Seconds a join (and the group's collectives) may wait: the request's, at most the server's."""
        limit = self.engine.opts.weight_group_timeout_s
        asked = _field(body, "timeout_s", (int, float), None)
        if asked is None:
            return limit
        if asked <= 0:
            raise BadRequest(f"timeout_s: {asked} must be > 0")
        return min(float(asked), limit)


def _error_status(req: Request) -> int:
    """The HTTP status of a request the engine failed (500), else 0: aborts answer 200 as in SGLang."""
    reason = req.finish_reason or {}
    status = reason.get("status_code") or 0
    return status if reason.get("type") == "abort" and status >= 400 else 0


def _resolve(future: asyncio.Future[Request], req: Request) -> None:
    if not future.done():
        future.set_result(req)


def _architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM"}[model_type]
