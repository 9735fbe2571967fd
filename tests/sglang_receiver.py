"""A rollout server's weight-receiving side assembled from SGLang 0.5.23's own code, for tests.

SGLang itself needs a GPU, so this process stands in for one SGLang server with TP 1, built from
the pieces of the installed wheel that run on CPU (see ``sglang_ref``):

- every request body is validated by SGLang's own request class for that endpoint (the
  pydantic schema its HTTP server uses); a field SGLang does not know is refused too, because
  SGLang would silently drop it;
- ``/init_weights_update_group`` joins through SGLang's ``init_custom_process_group`` (gloo);
- ``/update_weights_from_distributed`` receives as SGLang's ``WeightUpdater`` does: one
  ``broadcast`` per tensor in ``names`` order, or SGLang's ``FlattenedTensorBucket`` for
  ``load_format="flattened_bucket"`` (which refuses unaligned offsets);
- weight operations run one at a time in arrival order (SGLang's scheduler blocks inside the
  broadcast), and updates are refused outside ``/begin_weight_update`` ... ``/end_weight_update``;
- ``/generate`` checks the body against ``GenerateReqInput``'s fields and SGLang's
  ``SamplingParams``, and answers with ``meta_info`` whose ``weight_versions`` spans come from
  SGLang's own ``compute_weight_version_spans`` / ``add_weight_versions_to_meta_info``.

What it does not do: run a model (received tensors are kept by name and fingerprinted at
``/weights_checksum``, the embedded server's format) or abort anything.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import sglang_ref
import torch
import torch.distributed as dist
from aiohttp import web

REQUESTS = {  # endpoint -> SGLang's request class (sglang/srt/entrypoints/http_server.py)
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}
VOCAB = 1 << 16
JOIN_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 20.0  # SGLang answers 503 when its one-token health probe takes longer


def io_struct() -> Any:
    """SGLang's request classes (definitions compiled from ``managers/io_struct.py``)."""
    import msgspec

    msgspec_utils = sglang_ref.module("sglang.srt.utils.msgspec_utils")
    versions = sglang_ref.module("sglang.srt.utils.weight_versions")
    names = ["BaseReq", "FinishReasonDict", "GenerateReqInput", *REQUESTS.values()]
    return sglang_ref.definitions("sglang.srt.managers.io_struct", names, env={
        "msgspec": msgspec, "msgspec_struct_pydantic_core_schema": msgspec_utils.msgspec_struct_pydantic_core_schema,
        "WeightVersionSpans": versions.WeightVersionSpans, "dataclass": dataclasses.dataclass,
        "field": dataclasses.field})


class Refused(Exception):
    pass


def validate(cls: type, body: dict[str, Any]) -> Any:
    """Parse ``body`` with SGLang's schema for ``cls``; unknown fields are refused as well."""
    import pydantic

    unknown = sorted(set(body) - set(cls.__struct_fields__))
    if unknown:
        raise Refused(f"{cls.__name__} has no field(s) {unknown}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(body)
    except pydantic.ValidationError as e:
        raise Refused(f"{cls.__name__}: {e}") from None


class Receiver:
    def __init__(self) -> None:
        self.io = io_struct()
        self.init_group = sglang_ref.init_custom_process_group()
        self.bucket_cls = sglang_ref.flattened_tensor_bucket()
        self.sampling = sglang_ref.module("sglang.srt.sampling.sampling_params").SamplingParams
        self.versions = sglang_ref.module("sglang.srt.utils.weight_versions")
        self.worker = ThreadPoolExecutor(1)  # one weight operation at a time, in arrival order
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.in_session = False
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.adapters: dict[str, str] = {}  # LoRA name -> the folder it was loaded from
        self.received: list[dict[str, Any]] = []  # every validated body, in arrival order
        self.updates: list[str] = []  # group name of every received bucket, in order
        self.running = asyncio.Event()  # cleared by /pause_generation, set by /continue_generation
        self.running.set()
        self.refuse_next_update = False  # test knob: the next update fails as a bad load would

    # ---- weight operations (on the worker thread) ------------------------------------------
    def _init(self, req: Any) -> None:
        init_method = f"tcp://{req.master_address}:{req.master_port}"
        self.groups[req.group_name] = self.init_group(
            backend=req.backend, init_method=init_method, world_size=req.world_size, rank=req.rank_offset,
            group_name=req.group_name, timeout=timedelta(seconds=JOIN_TIMEOUT_S))

    def _destroy(self, req: Any) -> None:
        dist.destroy_process_group(self.groups.pop(req.group_name))

    def _receive(self, req: Any) -> None:
        if not self.in_session:
            raise Refused("update outside /begin_weight_update ... /end_weight_update")
        group = self.groups[req.group_name]
        if req.load_format == "flattened_bucket":
            try:
                bucket = self.bucket_cls.empty(req.names, req.dtypes, req.shapes, "cpu")
            except ValueError as e:
                raise Refused(str(e)) from None
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            named = bucket.reconstruct_tensors()
        else:
            named, handles = [], []
            for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
                named.append((name, weight))
            for handle in handles:
                handle.wait()
        if self.refuse_next_update:  # received, then the load fails (SGLang replies success: false)
            self.refuse_next_update = False
            raise Refused("Failed to update parameter online (refused once by the test)")
        self.tensors.update((name, t.clone()) for name, t in named)
        self.updates.append(req.group_name)
        if req.weight_version is not None:
            self.version = req.weight_version

    # ---- HTTP ----------------------------------------------------------------------------
    async def control(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw.strip() else {}
        try:
            req = validate(getattr(self.io, REQUESTS[request.path]), body)
            self.received.append({"path": request.path, "body": body})
            await self._apply(request.path, req)
        except Refused as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": "ok"})

    async def _apply(self, path: str, req: Any) -> None:
        run = asyncio.get_running_loop().run_in_executor
        if path == "/init_weights_update_group":
            await run(self.worker, self._init, req)
        elif path == "/destroy_weights_update_group":
            await run(self.worker, self._destroy, req)
        elif path == "/update_weights_from_distributed":
            await run(self.worker, self._receive, req)
        elif path == "/begin_weight_update":
            self.in_session = True
        elif path == "/end_weight_update":
            self.in_session = False
        elif path == "/update_weight_version":
            self.version = req.new_version
        elif path == "/pause_generation":
            self.running.clear()
        elif path == "/continue_generation":
            self.running.set()
        elif path == "/load_lora_adapter":  # a name loaded twice is refused (srt/lora/lora_manager.py)
            if req.lora_name in self.adapters:
                raise Refused(f"Failed to load LoRA adapter {req.lora_name} because it is already loaded")
            self.adapters[req.lora_name] = req.lora_path
        elif path == "/unload_lora_adapter":
            if self.adapters.pop(req.lora_name, None) is None:
                raise Refused(f"LoRA adapter {req.lora_name} is not loaded")

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        fields = {f.name for f in dataclasses.fields(self.io.GenerateReqInput)}
        unknown = sorted(set(body) - fields)
        try:
            if unknown:
                raise Refused(f"GenerateReqInput has no field(s) {unknown}")
            params = self.sampling(**body.get("sampling_params", {}))
            params.verify(VOCAB)
        except (Refused, TypeError, ValueError) as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        self.received.append({"path": "/generate", "body": body})
        return web.json_response(self._generated(body, params))

    def _generated(self, body: dict[str, Any], params: Any) -> dict[str, Any]:
        """Three tokens, the first two under the previous version (one update mid-request)."""
        n = min(3, params.max_new_tokens or 3)
        ids = [(sum(body["input_ids"]) + i) % VOCAB for i in range(n)]
        events = [self.versions.WeightVersionEvent(old_version="previous", num_output_tokens=min(2, n))]
        spans = self.versions.compute_weight_version_spans(events, self.version, n)
        meta: dict[str, Any] = {"id": body.get("rid", "r"), "prompt_tokens": len(body["input_ids"]),
                                "completion_tokens": n, "cached_tokens": 0,
                                "finish_reason": {"type": "length", "length": n},
                                "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)]}
        self.versions.add_weight_versions_to_meta_info(meta, spans, n)
        return {"text": "", "output_ids": ids, "meta_info": meta}

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version, "model_path": "receiver",
                                  "is_generation": True})

    async def checksums(self, request: web.Request) -> web.Response:
        from megatron_areal.server.weights import tensor_checksum

        sums = {n: {"sha256": tensor_checksum(t)} for n, t in self.tensors.items()}
        return web.json_response({"weight_version": self.version, "checksums": sums})

    async def log(self, request: web.Request) -> web.Response:
        return web.json_response({"received": self.received, "updates": self.updates})

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def health(self, request: web.Request) -> web.Response:
        """As SGLang's ``/health``: it generates one token, so while paused it waits, then 503."""
        try:
            await asyncio.wait_for(self.running.wait(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(text="")

    async def refuse_next(self, request: web.Request) -> web.Response:
        self.refuse_next_update = True
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 26)
        for path in REQUESTS:
            app.router.add_post(path, self.control)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/weights_checksum", self.checksums)
        app.router.add_get("/received", self.log)
        app.router.add_get("/health", self.health)
        app.router.add_post("/test/refuse_next_update", self.refuse_next)
        app.router.add_route("*", "/flush_cache", self.ok)
        return app


def main(port: int) -> None:
    web.run_app(Receiver().app(), host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
