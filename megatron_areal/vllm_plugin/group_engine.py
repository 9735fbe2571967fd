"""``GroupWeightTransferEngine``: the receiving side of the trainer's weight push inside a vLLM worker.

It joins the trainer's weight-update group exactly as the embedded server and SGLang do
(``weights/wire.join_group``: the trainer is rank 0 and hosts the store, this worker is rank
``rank_offset + its rank in the server``) over gloo on CPU (``GlooWeightTransferEngine``) or NCCL on
GPUs (``NcclWeightTransferEngine``: vLLM's own ``nccl`` engine forms its group with a rendezvous of its
own and cannot join the trainer's), receives each announced bucket by broadcast from rank 0 into
tensors on the worker's device, and loads it with the model's own ``load_weights`` inside vLLM's
layerwise-reload lifecycle (CPU linear layers may repack their weights after loading, so a plain
``load_weights`` would leave the repacked copies stale).

Update info: ``names``, ``dtypes`` (torch attribute names), ``shapes``, and ``flattened``: one uint8
broadcast holding the tensors back to back without padding (``weights/buckets.py``) instead of one
broadcast per tensor.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_areal.vllm_plugin.adapters import VLLMAdapterMerge
from megatron_areal.weights.shard_receive import Spares, check_manifest, receive_slices
from megatron_areal.weights.wire import adapter_target, join_group

log = logging.getLogger(__name__)


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """Where the trainer's group meets: the body of ``/init_weight_transfer_engine``'s ``init_info``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    timeout_s: float = 300.0


@dataclass
class GroupUpdateInfo(WeightTransferUpdateInfo):
    """One bucket, or a whole shard push: the body of ``/update_weights``'s ``update_info``."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    flattened: bool = False
    group_name: str | None = None  # checked against the group this worker joined, when given
    # a shard push (``weights/shard_receive.py``): slices from ``senders`` trainer ranks, point to point, as listed
    manifest: dict[str, Any] | None = None
    senders: int = 0
    timeout_s: float = 300.0
    lora_scale: float | None = None  # the bucket holds a model.lora run's adapters (``adapters.py`` merges them)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtypes)} dtypes and "
                             f"{len(self.shapes)} shapes must be as many")
        for name, dtype in zip(self.names, self.dtypes):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"update_info: dtype {dtype!r} of {name!r} is not a torch dtype name")
            if not getattr(torch, dtype).is_floating_point:  # copied into a float weight, it would truncate it
                raise ValueError(f"update_info: dtype {dtype!r} of {name!r} is not a floating-point type; "
                                 "weights must be floating point")


class GroupWeightTransferEngine(WeightTransferEngine[GroupInitInfo, GroupUpdateInfo]):
    """Weights from the trainer over a ``torch.distributed`` group of backend ``group_backend``."""

    group_backend = "gloo"
    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self.adapters: VLLMAdapterMerge | None = None  # made at the first adapter push
        self.spares: Spares | None = None  # a shard push's tensors, reused by the next (made at the first)

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        """Join the trainer's group as ``rank_offset`` + this worker's rank among the server's workers."""
        if self.group is not None:
            self.shutdown()  # a new group replaces the old one (the trainer re-forms it after a drop)
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker_rank
        log.info("joining weight update group %s at %s:%d as rank %d/%d", init_info.group_name,
                 init_info.master_address, init_info.master_port, rank, init_info.world_size)
        self.group = join_group(init_info.master_address, init_info.master_port, rank=rank,
                                world_size=init_info.world_size, group_name=init_info.group_name,
                                backend=self.group_backend, timeout=timedelta(seconds=init_info.timeout_s))
        self.group_name = init_info.group_name

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator after receiving; gloo on CPU has already blocked.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(f"{self.group_backend} weight transfer: /update_weights before "
                               "/init_weight_transfer_engine")
        if update_info.group_name is not None and update_info.group_name != self.group_name:
            raise ValueError(f"update_info.group_name {update_info.group_name!r} is not the group this worker "
                             f"joined ({self.group_name!r})")
        if update_info.manifest is not None:
            self._receive_shards(update_info)
            return
        dtypes = [getattr(torch, d) for d in update_info.dtypes]
        if update_info.flattened:
            weights = self._receive_flat(update_info.names, dtypes, update_info.shapes)
        else:
            weights = []
            for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, group=self.group, group_src=0)
                weights.append((name, tensor))
        if any(adapter_target(name) is not None for name in update_info.names):
            if self.adapters is None:
                self.adapters = VLLMAdapterMerge(self.model_config.model, self.model_config.dtype)
            weights = self.adapters.weights(dict(weights), update_info.lora_scale)
        self.model.load_weights(weights)

    def _receive_shards(self, update_info: GroupUpdateInfo) -> None:
        """Assemble whole HF tensors from the trainer ranks' slices; vLLM's loader cuts this worker's part."""
        limit = 8 * sum(p.numel() for p in self.model.parameters())  # fp32, twice over
        rounds = check_manifest(update_info.manifest, senders=update_info.senders, max_bytes=limit)
        if self.spares is None:  # vLLM's loader copies what it is given: the tensors can carry the next push
            self.spares = Spares(limit_bytes=limit // 2)

        def load(tensors: dict[str, torch.Tensor]) -> None:
            self.model.load_weights(list(tensors.items()))
            for name in list(tensors):
                self.spares.give(tensors.pop(name))

        receive_slices(self.group, rounds, timeout_s=update_info.timeout_s, device=self.device, on_complete=load,
                       spares=self.spares)

    def _receive_flat(self, names: list[str], dtypes: list[torch.dtype],
                      shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        sizes = [math.prod(shape) * torch.empty((), dtype=d).element_size() for d, shape in zip(dtypes, shapes)]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, group=self.group, group_src=0)
        out, offset = [], 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes):
            out.append((name, buffer[offset:offset + size].view(dtype).view(shape)))
            offset += size
        return out

    def shutdown(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.shutdown()
            dist.destroy_process_group(group)


class GlooWeightTransferEngine(GroupWeightTransferEngine):
    """For vLLM's CPU workers."""

    group_backend = "gloo"


class NcclWeightTransferEngine(GroupWeightTransferEngine):
    """For vLLM's GPU workers: the trainer's NCCL group (not vLLM's own ``nccl`` engine)."""

    group_backend = "nccl"
