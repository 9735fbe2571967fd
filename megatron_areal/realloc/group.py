"""The weight-update process group shared by the trainer (rank 0) and the rollout servers.

The trainer already owns a default (Megatron) process group, so this group must not touch it:
it gets its own TCPStore hosted by rank 0, namespaced by ``group_name`` through a PrefixStore,
and a backend object (gloo on CPU, NCCL on GPU) built directly on that store. Servers join with
``rank = rank_offset + tp_rank``, the same convention SGLang uses.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class WeightUpdateGroup:
    """A standalone collective group; only broadcast and barrier are needed for weights."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 300.0, device: torch.device | str | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"weight update group {group_name!r}: rank {rank} outside world of {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight update group {group_name!r}: backend {backend!r} is not gloo or nccl")
        self.rank, self.world_size = rank, world_size
        self.group_name, self.backend = group_name, backend
        timeout = timedelta(seconds=timeout_s)
        log.info("joining weight update group %s at %s:%d as rank %d/%d (%s)", group_name,
                 master_address, master_port, rank, world_size, backend)
        self._tcp_store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                        timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(group_name, self._tcp_store)
        self.device = torch.device("cpu")
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Loopback-safe: the default device resolves the hostname, which may not route.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_ip(master_address))]
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            # Pass the device explicitly from worker threads: their current CUDA device is cuda:0.
            self.device = torch.device(device) if device is not None else \
                torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of ``tensor`` from group rank ``src`` (blocking)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self._pg.allreduce([flag]).wait()

    def destroy(self) -> None:
        """Release the backend and the store; the object is unusable afterwards."""
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self._pg = None  # type: ignore[assignment]
        self._tcp_store = None  # type: ignore[assignment]


def _local_ip(master_address: str) -> str:
    """The address of this host's interface that reaches ``master_address``."""
    if master_address in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_address, 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()
