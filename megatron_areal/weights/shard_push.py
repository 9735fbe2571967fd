"""The trainer's side of a shard push (the embedded server and vLLM through our plugin): every trainer rank
sends its own slices, as the transfer plan says, over one group of all senders and server ranks.

Senders come first in the group (the lowest, trainer rank 0, hosts its store), then each server's ranks.
Rank 0 tells each server in one request what will arrive (``streams.manifest_for``) while every sender
sends its buckets point to point (``shard_send``); the servers assemble whole tensors and install them.
Collective over the trainer's control group like the rest of ``WeightSync``: every rank calls ``form``
and ``push`` with the same servers.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.fleet.fleet import Fleet, wait_all
from megatron_areal.model.arch import ModelArch
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, TransferPlan, make_plan
from megatron_areal.weights.shard_send import SendStats, SliceSource, send_streams
from megatron_areal.weights.streams import all_streams, manifest_for, streams_of
from megatron_areal.weights.wire import WeightUpdateGroup

log = logging.getLogger(__name__)


class ShardPush:
    """One trainer rank's part in shard pushes to a fixed set of servers (re-formed when it changes)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *,
                 fleet: Fleet | None, control_group: dist.ProcessGroup | None, master_address: str, backend: str,
                 timeout_s: float, bucket_bytes: int, in_flight: int, dtype: torch.dtype | None,
                 broadcast: Callable[[Any], Any]) -> None:
        self.arch, self.fleet, self.control_group = arch, fleet, control_group
        self.layout = TrainerLayout(groups.tp, groups.pp, groups.dp, groups.ep, groups.etp)
        self.rank = dist.get_rank(control_group)
        self.source = SliceSource(chunks, arch, self.layout, self.rank)
        first = next(iter(self.source.params.values()))
        self.dtype = dtype or first.dtype
        self.device = groups.device
        self.master_address, self.backend, self.timeout_s = master_address, backend, timeout_s
        self.bucket_bytes, self.in_flight = bucket_bytes, in_flight
        self.broadcast = broadcast  # rank 0's value on every rank (over the control group)
        self.members: dict[str, int] | None = None
        self.plan: TransferPlan | None = None
        self.group: WeightUpdateGroup | None = None
        self.group_name = ""
        self.generation = 0
        self._traffic: tuple[list, dict[str, dict]] | None = None
        # rank 0's group names are ones no earlier push object used: a server that missed a destroy still
        # holds the old group
        self.token = uuid.uuid4().hex[:8]

    def plan_for(self, servers: dict[str, int]) -> TransferPlan:
        tps = set(servers.values())
        if len(tps) > 1:
            raise ValueError(f"a shard push needs servers of one TP size; these have {sorted(tps)}")
        return make_plan(self.arch, self.layout, ServerLayout(len(servers), tps.pop() if tps else 1),
                         dtype_bytes=self.dtype.itemsize)

    def receiver_ranks(self, servers: dict[str, int], senders: int) -> tuple[dict, dict]:
        """Group rank and name of every (server, rank)."""
        ranks, names, offset = {}, {}, senders
        for i, (url, tp) in enumerate(servers.items()):
            for r in range(tp):
                ranks[(i, r)], names[(i, r)] = offset + r, f"{url} (rank {r})"
            offset += tp
        return ranks, names

    def form(self, servers: dict[str, int]) -> dict[str, str]:
        """Collective: form the group with exactly ``servers``; {url: error} of what failed, as this rank saw it."""
        self.close(list(servers))
        self.generation += 1
        plan = self.plan_for(servers)
        senders = plan.senders
        if senders[0] != 0:
            raise RuntimeError(f"trainer rank 0 sends nothing in the plan ({senders[:4]}...): it must host the group")
        world = len(senders) + sum(servers.values())
        name = f"weights-shards-{self.token}-gen{self.generation}"
        mine = (self.master_address, free_port(self.master_address), name)
        address, port, name = self.broadcast(mine if self.rank == 0 else None)  # rank 0 hosts the group's store
        futures, offset = {}, len(senders)
        if self.rank == 0:
            assert self.fleet is not None
            for url, tp in servers.items():
                futures[url] = self.fleet.submit(url, lambda c, o=offset: weight_calls(c).init_weights_update_group(
                    master_address=address, master_port=port, rank_offset=o, world_size=world, group_name=name,
                    backend=self.backend))
                offset += tp
        errors: dict[str, str] = {}
        if self.rank in senders:
            try:
                self.group = WeightUpdateGroup(master_address=address, master_port=port, rank=senders.index(self.rank),
                                               world_size=world, group_name=name, backend=self.backend,
                                               timeout_s=self.timeout_s,
                                               device=self.device if self.backend == "nccl" else None)
            except RuntimeError as e:
                errors = {url: f"{url}: joining {name}: {e}" for url in servers}
        if futures:
            replies = wait_all(futures, self.timeout_s)
            errors = replies or errors
        self.members, self.plan, self.group_name = dict(servers), plan, name
        self._traffic = None  # this rank's streams and rank 0's manifests, cut once per group
        if not errors and self.rank == 0:
            log.info("shard push group %s formed: %d senders, %d servers (world %d)", name, len(senders),
                     len(servers), world)
        return errors

    def push(self, version: str) -> tuple[SendStats, dict[str, str]]:
        """Collective: send this rank's slices; rank 0 also announces the manifests and collects the servers'
        replies. Returns this rank's send statistics and {url: error}."""
        assert self.plan is not None and self.members is not None
        plan, servers = self.plan, self.members
        senders = plan.senders
        ranks, names = self.receiver_ranks(servers, len(senders))
        mine, manifests = self._traffic or self._cut_traffic()
        futures, rounds = {}, max((len(m["rounds"]) for m in manifests.values()), default=1)
        if self.rank == 0:
            assert self.fleet is not None
            for url, manifest in manifests.items():
                futures[url] = self.fleet.submit(url, lambda c, m=manifest: weight_calls(c).update_weights_from_shards(
                    manifest=m, senders=len(senders), group_name=self.group_name, weight_version=version,
                    timeout_s=self.timeout_s))
        stats = SendStats()
        if self.group is not None:
            stats = send_streams(mine, self.source, group=self.group.pg, receiver_rank=ranks, receiver_name=names,
                                 dtype=self.dtype, bucket_bytes=self.bucket_bytes, in_flight=self.in_flight,
                                 timeout_s=self.timeout_s, device=self.device)
            if stats.errors:  # close our end now: receivers waiting for this rank fail at once, not at their timeout
                self.group.destroy()
                self.group = None
        errors = dict(stats.errors)
        if futures:
            replies = wait_all(futures, self.timeout_s * (rounds + 2))
            errors = {**errors, **replies}
        return stats, errors

    def _cut_traffic(self) -> tuple[list, dict[str, dict]]:
        """This rank's streams and, on rank 0, every server's manifest: the same for every push to these servers."""
        assert self.plan is not None and self.members is not None
        plan, senders = self.plan, self.plan.senders
        mine = streams_of(plan, self.rank, bucket_bytes=self.bucket_bytes, dtype=self.dtype)
        manifests = {}
        if self.rank == 0:
            streams = all_streams(plan, bucket_bytes=self.bucket_bytes, dtype=self.dtype)
            group_rank = {s: i for i, s in enumerate(senders)}
            describe = {s: self.layout.describe(s) for s in senders}
            manifests = {url: manifest_for(streams, i, group_rank=group_rank, describe=describe, dtype=self.dtype)
                         for i, url in enumerate(self.members)}
        self._traffic = (mine, manifests)
        return self._traffic

    def close(self, live: list[str]) -> None:
        """Leave the group and ask the live servers to drop theirs (best effort)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
        if self.rank == 0 and self.members is not None and self.fleet is not None:
            urls = [u for u in self.members if u in live]
            for message in self.fleet.each(urls, lambda c: weight_calls(c).destroy_weights_update_group(
                    self.group_name), timeout_s=min(self.timeout_s, 30.0)).values():
                log.warning("destroying %s: %s", self.group_name, message)
        self.members = self.plan = self._traffic = None
