"""The weight-update calls of a rollout server, as the trainer's push makes them, one class per protocol.

SGLang and the embedded server share one set of routes (``/init_weights_update_group``,
``/update_weights_from_distributed``, ...; SGLang 0.5.23 wraps them in ``/begin_weight_update`` ...
``/end_weight_update``, which older servers answer 404 to, harmlessly). vLLM's are those of its
weight-transfer engine (served with ``VLLM_SERVER_DEV_MODE=1``, our group engine in ``vllm_plugin/``):

| call                                    | vLLM                                                        |
|-----------------------------------------|-------------------------------------------------------------|
| ``init_weights_update_group``           | ``POST /init_weight_transfer_engine`` (replaces the group)  |
| ``begin_weight_update`` / ``end_...``   | ``POST /start_weight_update`` / ``/finish_weight_update``   |
| ``update_weights_from_distributed``     | ``POST /update_weights``                                    |

The calls ride on the server's client (``fleet/``: its session, API key and error reporting);
``weight_calls(client)`` picks the class for the client's engine.
"""
from __future__ import annotations

import logging
from typing import Any

from megatron_areal.fleet.client import RolloutClient, ServerError
from megatron_areal.fleet.vllm_client import VLLMClient

log = logging.getLogger(__name__)


class WeightCalls:
    """SGLang's and the embedded server's weight routes on one server."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> None:
        """Ask the server to join the trainer's weight-update group (the trainer joins at the same time)."""
        await self.client.control("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Ask the server to leave a weight-update group."""
        await self.client.control("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23; a no-op where the route does not exist)."""
        await self.client.request("POST", "/begin_weight_update", {"selector": "all"}, ok404=True)

    async def end_weight_update(self) -> None:
        """Close the weight-update session."""
        await self.client.request("POST", "/end_weight_update", {}, ok404=True)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], weight_version: str | None = None,
                                              group_name: str = "weight_update_group",
                                              flattened_bucket: bool = False, flush_cache: bool = True,
                                              timeout_s: float | None = None, lora_scale: float | None = None) -> None:
        """Announce one bucket; the caller broadcasts the tensors while this call is pending.

        Wrap a sequence of buckets in ``begin_weight_update()`` / ``end_weight_update()``. ``lora_scale``: the
        bucket holds adapters (the embedded server's own field, ``wire.AdapterMerge``).
        """
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes,
                                "group_name": group_name, "flush_cache": flush_cache,
                                "weight_version": weight_version}
        if flattened_bucket:
            body["load_format"] = "flattened_bucket"
        if lora_scale is not None:
            body["lora_scale"] = lora_scale
        await self.client.control("/update_weights_from_distributed", body, timeout_s=timeout_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       timeout_s: float | None = None) -> None:
        """Load the whole model from a folder on a filesystem the server reads."""
        await self.client.control("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version, "flush_cache": True},
            timeout_s=timeout_s)

    async def update_weights_from_shards(self, *, manifest: dict[str, Any], senders: int, group_name: str,
                                         weight_version: str | None, timeout_s: float) -> None:
        """The whole shard push in one request (the embedded server's own route): the server receives
        the slices ``manifest`` lists from the ``senders`` trainer ranks while this call is pending."""
        await self.client.control("/update_weights_from_shards", {
            "manifest": manifest, "senders": senders, "group_name": group_name, "weight_version": weight_version,
            "timeout_s": timeout_s}, timeout_s=timeout_s * (len(manifest["rounds"]) + 2))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False,
                                timeout_s: float | None = None) -> None:
        """SGLang's ``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``): load the PEFT folder ``lora_path``, on a
        filesystem the server reads, as adapter ``lora_name``; requests name it in ``lora_path``. SGLang answers
        ``success: false`` (HTTP 400) for a name already loaded."""
        await self.client.control("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path,
                                                         "pinned": pinned}, timeout_s=timeout_s)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """SGLang's ``/unload_lora_adapter`` (``UnloadLoRAAdapterReqInput``)."""
        await self.client.control("/unload_lora_adapter", {"lora_name": lora_name})


class VLLMWeightCalls(WeightCalls):
    """vLLM's weight-transfer routes on one server (the plugin's group engine receives)."""

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> None:
        """``/init_weight_transfer_engine``; the engine's backend was fixed at launch (``launch/vllm.py``)."""
        await self.client.control("/init_weight_transfer_engine", {"init_info": {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "timeout_s": self.client.control_timeout_s}})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Nothing over HTTP: vLLM refuses ``/shutdown_weight_transfer_engine`` inside a weight-update
        session (and its engine core dies of the refusal), and the weight push re-forms groups inside
        sessions (a server joining, the membership changing). The trainer closes its end; the server's
        engine replaces its group at the next ``/init_weight_transfer_engine`` (``vllm_plugin/group_engine``)."""
        log.debug("%s: weight group %s left to be replaced at the next init", self.client.url, group_name)

    async def begin_weight_update(self) -> None:
        """``/start_weight_update``."""
        await self.client.control("/start_weight_update", {})

    async def end_weight_update(self) -> None:
        """``/finish_weight_update``."""
        await self.client.control("/finish_weight_update", {})

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], weight_version: str | None = None,
                                              group_name: str = "weight_update_group",
                                              flattened_bucket: bool = False, flush_cache: bool = True,
                                              timeout_s: float | None = None, lora_scale: float | None = None) -> None:
        """``/update_weights`` with one bucket (adapters with ``lora_scale``: our plugin merges them); the caller
        broadcasts it while this call is pending. Then ``/update_weight_version``: the server is paused (the
        weight push pauses it first), so no token is generated between the label and the weights it names;
        each pipeline stage's head labels its own buckets, so no call needs to know which bucket is the last."""
        info: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "flattened": flattened_bucket,
                                "group_name": group_name}
        if lora_scale is not None:
            info["lora_scale"] = lora_scale
        await self.client.control("/update_weights", {"update_info": info}, timeout_s=timeout_s)
        if weight_version is not None:
            await self.client.control("/update_weight_version", {"new_version": str(weight_version)})

    async def update_weights_from_shards(self, *, manifest: dict[str, Any], senders: int, group_name: str,
                                         weight_version: str | None, timeout_s: float) -> None:
        """``/update_weights`` with the shard push's manifest (our plugin's engine receives it), then the label."""
        await self.client.control("/update_weights", {"update_info": {
            "manifest": manifest, "senders": senders, "group_name": group_name, "timeout_s": timeout_s}},
            timeout_s=timeout_s * (len(manifest["rounds"]) + 2))
        if weight_version is not None:
            await self.client.control("/update_weight_version", {"new_version": str(weight_version)})

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       timeout_s: float | None = None) -> None:
        """Not offered: vLLM 0.32 has no public route that loads a new checkpoint folder into a running
        server (use ``weights.method: distributed``)."""
        raise ServerError(self.client.url, "/update_weights_from_disk", "the vLLM backend takes weights only through "
                          "its weight-transfer engine (weights.method: distributed)", status=400)


def weight_calls(client: RolloutClient) -> WeightCalls:
    """The weight calls of the server behind ``client``, in its engine's protocol."""
    return VLLMWeightCalls(client) if isinstance(client, VLLMClient) else WeightCalls(client)
