"""Bootstrap torch.distributed and Megatron's model-parallel state for one TP x PP x DP layout.

MoE models add expert parallelism: the experts of each layer are split over ``ep`` ranks and each
expert's weights over ``etp`` ranks. Megatron lays the expert groups over the same ranks as
TP x DP (``ep * etp`` must divide ``world / pp``), so EP lives inside data parallelism.

This is the one place that touches ``megatron.core.parallel_state``; everything else receives the
``ParallelGroups`` it returns. ``teardown_parallel`` destroys Megatron's groups (not the world), so
one process group can be re-initialised with another layout, which the distributed tests rely on.
Rank order is Megatron's default ``tp-cp-ep-dp-pp``: TP ranks are adjacent.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_areal.patches.cpu_gloo import apply_cpu_patch

log = logging.getLogger(__name__)

# The process groups ``initialize_model_parallel`` created for the current layout. Megatron's
# ``destroy_model_parallel`` only forgets them, and every gloo group keeps its sockets and about three
# threads, so a pool that tried many layouts ended with hundreds of groups per rank; teardown destroys them.
_LAYOUT_GROUPS: list[dist.ProcessGroup] = []


def live_process_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process other than the world (torch keeps no public list of them)."""
    from torch.distributed.distributed_c10d import GroupMember, _world

    return [pg for pg in _world.pg_map if pg is not GroupMember.WORLD]


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups and coordinates of this rank in the current layout."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # TP x PP: the ranks holding one full model replica
    backend: str
    device: torch.device
    ep: int = 1  # expert parallel: ranks the experts of a layer are split over
    etp: int = 1  # expert tensor parallel: ranks each expert's weights are split over
    ep_rank: int = 0
    etp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None
    edp_rank: int = 0  # expert data parallel: which copy of the experts this rank's expert shards belong to

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"parallel.backend: {backend!r} is not one of 'auto', 'gloo', 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend: 'nccl' needs CUDA, which this machine does not have")
    return backend


def init_world(backend: str = "auto", timeout_minutes: int = 30) -> str:
    """Initialise torch.distributed from the usual env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) once."""
    backend = resolve_backend(backend)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_backend()


def check_world(world: int, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
    """Refuse a layout the world size cannot be split into, naming the numbers."""
    if min(tp, pp, ep, etp) < 1 or world % (tp * pp) != 0:
        raise ValueError(f"parallel: world size {world} is not divisible by tp ({tp}) x pp ({pp})")
    if (world // pp) % (ep * etp) != 0:
        raise ValueError(f"parallel: ep ({ep}) x etp ({etp}) must divide world size / pp = {world // pp} "
                         "(expert parallelism is laid over the tensor- and data-parallel ranks)")


def min_world(tp: int, pp: int, ep: int = 1, etp: int = 1) -> int:
    """The smallest world size that holds the layout: pp x lcm(tp, ep x etp)."""
    return pp * math.lcm(tp, ep * etp)


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1, backend: str = "auto", ep: int = 1,
                  etp: int = 1) -> ParallelGroups:
    """Set up Megatron's TP/PP/DP (and, for MoE models, EP/expert-TP) groups on the world."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    backend = init_world(backend)
    world = dist.get_world_size()
    check_world(world, tp, pp, ep, etp)
    if backend == "gloo":
        apply_cpu_patch()
    if mpu.model_parallel_is_initialized():
        teardown_parallel()
    before = set(live_process_groups())
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                  create_gloo_process_groups=backend != "gloo")
    _LAYOUT_GROUPS[:] = [pg for pg in live_process_groups() if pg not in before]
    model_parallel_cuda_manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    groups = ParallelGroups(
        tp=tp, pp=pp, dp=world // (tp * pp),
        tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(), pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(), mp_group=mpu.get_model_parallel_group(),
        backend=backend, device=device, ep=ep, etp=etp,
        ep_rank=mpu.get_expert_model_parallel_rank(), etp_rank=mpu.get_expert_tensor_parallel_rank(),
        ep_group=mpu.get_expert_model_parallel_group(), etp_group=mpu.get_expert_tensor_parallel_group(),
        edp_rank=mpu.get_expert_data_parallel_rank())
    log.info("parallel layout tp=%d pp=%d dp=%d ep=%d etp=%d (%s); this rank tp=%d pp=%d dp=%d ep=%d", tp, pp,
             groups.dp, ep, etp, backend, groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.ep_rank)
    return groups


def teardown_parallel() -> None:
    """Destroy Megatron's model-parallel groups and caches; the world group stays."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    live = set(live_process_groups())
    for pg in _LAYOUT_GROUPS:
        if pg in live:  # Megatron destroys its gloo copies of the DP groups itself
            dist.destroy_process_group(pg)
    _LAYOUT_GROUPS.clear()
    # The global memory buffer and RNG tracker survive destroy_model_parallel; reset them so the
    # next layout starts clean.
    initialize_rng_tracker(force_reset=True)
