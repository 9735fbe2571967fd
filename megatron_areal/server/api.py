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

from megatron_areal.server.bodies import (
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    ParsePool,
    clip,
    field,
    read_json,
    version_field,
)
from megatron_areal.server.connections import ConnectionGuard, ConnectionLimits
from megatron_areal.server.engine import Engine, QueueFull
from megatron_areal.server.protocol import MAX_RID_CHARS, BadRequest, Limits, parse_generate, response
from megatron_areal.server.scheduler import Request
from megatron_areal.server.weight_queue import WeightQueue
from megatron_areal.server.weights import WeightError, parse_dtype
from megatron_areal.util import run_identity
from megatron_areal.weights.wire import SLICE_SUM

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/health_generate", "/ready", "/metrics", run_identity.ROUTE}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# The request's key: it carries the API key, or the server has none (a typed key from aiohttp 3.12).
KEYED: Any = web.RequestKey("keyed", bool) if hasattr(web, "RequestKey") else "keyed"
# Tensor names in a bucket: HF names are about a hundred characters.
MAX_TENSOR_NAME_CHARS = 1024
REPLY_INLINE_TOKENS = 4096  # a /generate reply with more output tokens is encoded on a parser thread


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": clip(message), "code": status}}, status=status)


def _refused(message: str) -> web.Response:
    return web.json_response({"success": False, "message": clip(message)}, status=400)


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
        self.parsers = ParsePool()

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
        r.add_get(run_identity.ROUTE, self.run_identity)
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
        keyed = request[KEYED] = not self.api_key or self._authorized(request)
        self.connections.started(transport, keyed=keyed)
        try:
            return await self._handle(request, handler)
        finally:
            self.connections.finished(transport, keyed=keyed)

    async def _handle(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request[KEYED] and request.path not in OPEN_PATHS:
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
        return await read_json(request, self.parsers, optional=optional,
                               timeout_s=self.connections.limits.body_timeout_s)

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        """``/generate``: one prompt or a batch; answers when every sample finished, and aborts them if the
        client goes away."""
        body = await self._body(request)
        e = self.engine
        parse = functools.partial(parse_generate, body, tokenizer=self.tokenizer, vocab=e.arch.vocab_size,
                                  limits=self.limits)
        # Tokenising (the tokenizer releases the GIL) and checking a large body's token ids run on a parser
        # thread, so that neither holds up the event loop.
        parsed = await self.parsers.maybe(request, parse, always="text" in body)
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
        version = e.weight_version

        def reply() -> bytes:
            out = [response(r, return_logprob=parsed.return_logprob, weight_version=version,
                            tokenizer=self.tokenizer, routed_experts_start_len=parsed.routed_experts_start_len)
                   for r in done]
            return json.dumps(out[0] if parsed.single else out).encode()

        # A long reply (up to ~10 MB) is encoded off the event loop too.
        body = await self.parsers.maybe(request, reply,
                                        always=sum(len(r.output_ids) for r in done) > REPLY_INLINE_TOKENS)
        return web.Response(body=body, content_type="application/json")

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
        ``/ready`` (503 while paused); 503 also when the model cannot step.

        A client without the key (these routes are open) gets, at once, only whether the engine can step:
        the same answer paused or not, so it can neither hold a connection through a pause nor learn when
        a weight push starts. The key holder (the trainer) gets SGLang's answer.
        """
        if not request[KEYED]:
            return web.Response(status=200) if self.engine.health()[0] else web.Response(status=503)
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
        mode = field(body, "mode", str, "abort")
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
        abort_all = field(body, "abort_all", bool, False)
        rid = field(body, "rid", str, "", max_chars=MAX_RID_CHARS)
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
        field(body, "selector", str, "all")
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
        version = version_field(body, "new_version")
        if field(body, "abort_all_requests", bool, True):
            await asyncio.to_thread(self.engine.abort, None)
        self.engine.weight_version = version
        return web.json_response({"success": True, "message": f"weight version {version}"})

    async def run_identity(self, request: web.Request) -> web.Response:
        """Proof that this server holds the nonce of the run that started it (``util/run_identity.py``)."""
        status, body = run_identity.answer(request.query.get("challenge", ""))
        return web.json_response(body, status=status)

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
        """Per-tensor sha256 (optionally after ``?dtype=bfloat16``), to compare weights bitwise; with
        ``?kind=slice_sum`` the weight push's checksum instead (``weights/wire.py``)."""
        name, kind = request.query.get("dtype"), request.query.get("kind", "sha256")
        if kind not in ("sha256", SLICE_SUM):
            raise BadRequest(f"kind: {kind!r} is not 'sha256' or {SLICE_SUM!r}")
        try:
            dtype = parse_dtype(name) if name else None
        except WeightError as err:
            raise BadRequest(str(err)) from None
        sums = await asyncio.to_thread(self.engine.checksums, dtype, kind)
        return web.json_response({"weight_version": self.engine.weight_version, "checksums": sums})

    # ---- weights -------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group``: join the trainer's group (on the weight thread, in arrival order)."""
        b = await self._body(request)
        await self.weights.run(
            self.engine.init_group, master_address=field(b, "master_address", str),
            master_port=field(b, "master_port", int), rank_offset=field(b, "rank_offset", int),
            world_size=field(b, "world_size", int),
            group_name=field(b, "group_name", str, "weight_update_group", max_chars=MAX_NAME_CHARS),
            backend=field(b, "backend", str, "nccl" if self.engine.device.type == "cuda" else "gloo"),
            timeout_s=self._join_timeout(b))
        return web.json_response({"success": True, "message": "joined the weight update group"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group``."""
        b = await self._body(request, optional=True)
        await self.weights.run(self.engine.destroy_group,
                               field(b, "group_name", str, "weight_update_group", max_chars=MAX_NAME_CHARS))
        return web.json_response({"success": True, "message": "destroyed"})

    async def update_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed``: receive one bucket of tensors by broadcast from the
        trainer and install it."""
        b = await self._body(request)
        names, dtypes, shapes = await self.parsers.maybe(request, lambda: _bucket_lists(b))
        load_format = field(b, "load_format", str, "")
        if load_format not in ("", "flattened_bucket"):
            raise BadRequest(f"load_format {load_format!r} is not supported")
        version = version_field(b, "weight_version", None)
        group_name = field(b, "group_name", str, "weight_update_group", max_chars=MAX_NAME_CHARS)
        if field(b, "abort_all_requests", bool, False):
            await asyncio.to_thread(self.engine.abort, None)
        lora_scale = field(b, "lora_scale", (int, float), None)  # ours: the bucket holds adapters (weights/wire.py)
        await self.weights.run(
            self.engine.update_from_distributed, names=names, dtypes=dtypes, shapes=shapes,
            group_name=group_name, version=version, flattened=load_format == "flattened_bucket",
            lora_scale=None if lora_scale is None else float(lora_scale))
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors"})

    async def update_shards(self, request: web.Request) -> web.Response:
        """``/update_weights_from_shards`` (ours): receive slices from the trainer ranks that hold them, as the
        manifest lists, point to point over the group, and install the assembled tensors
        (``weights/shard_receive.py``)."""
        b = await self._body(request)
        version = version_field(b, "weight_version", None)
        count = await self.weights.run(
            self.engine.update_from_shards, manifest=field(b, "manifest", dict), senders=field(b, "senders", int),
            group_name=field(b, "group_name", str, "weight_update_group", max_chars=MAX_NAME_CHARS),
            version=version, timeout_s=self._join_timeout(b))
        return web.json_response({"success": True, "message": f"updated {count} tensors"})

    async def update_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk``: load the whole model from a folder."""
        b = await self._body(request)
        path = field(b, "model_path", str, max_chars=MAX_PATH_CHARS)
        version = version_field(b, "weight_version", None)
        if field(b, "abort_all_requests", bool, False):
            await asyncio.to_thread(self.engine.abort, None)
        await self.weights.run(self.engine.update_from_disk, path, version)
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
        asked = field(body, "timeout_s", (int, float), None)
        if asked is None:
            return limit
        if asked <= 0:
            raise BadRequest(f"timeout_s: {asked} must be > 0")
        return min(float(asked), limit)


def _bucket_lists(b: dict[str, Any]) -> tuple[list[str], list[Any], list[list[Any]]]:
    """The ``names``, ``dtypes`` and ``shapes`` of an update from the trainer, checked as lists of equal length."""
    names, dtypes, shapes = field(b, "names", list), field(b, "dtypes", list), field(b, "shapes", list)
    if not (len(names) == len(dtypes) == len(shapes)) or not all(isinstance(n, str) for n in names) \
            or not all(isinstance(s, list) for s in shapes):
        raise BadRequest("names, dtypes and shapes must be lists of equal length")
    if any(len(n) > MAX_TENSOR_NAME_CHARS for n in names):
        raise BadRequest(f"names: a tensor name has more than {MAX_TENSOR_NAME_CHARS} characters")
    return names, dtypes, shapes


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
