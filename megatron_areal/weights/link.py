"""One pipeline stage's weight-update group: the stage head (rank 0) and every rank of every server.

Server ``i`` joins with ``rank_offset = 1 + sum of the TP sizes of servers before it``. The group is
formed while the ``/init_weights_update_group`` calls are in flight (the servers' ranks and the
head rendezvous at the head's store), and each bucket is broadcast while its
``/update_weights_from_distributed`` request is pending, as the protocol requires.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from megatron_areal.fleet.fleet import Fleet, wait_all
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.buckets import Bucket
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.wire import WeightUpdateGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """A bucket whose broadcast is done and whose HTTP replies may still be on the way."""

    futures: dict[str, cf.Future]
    broadcast_error: str | None


@dataclass(frozen=True)
class Member:
    """A server in a stage's weight-update group: its URL, how many ranks it brings, its first rank."""

    url: str
    tp: int  # ranks the server contributes to the group
    rank_offset: int


class StageLink:
    """The head side of one stage's group with a fixed set of servers."""

    def __init__(self, fleet: Fleet, servers: dict[str, int], *, stage: int, generation: int,
                 master_address: str, backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.fleet, self.stage, self.timeout_s = fleet, stage, timeout_s
        offset, members = 1, []
        for url, tp in servers.items():
            members.append(Member(url, tp, offset))
            offset += tp
        self.members, self.world_size = members, offset
        self.group_name = f"weights-stage{stage}-gen{generation}"
        self.master_address, self.backend, self.device = master_address, backend, device
        self.group: WeightUpdateGroup | None = None

    @property
    def urls(self) -> list[str]:
        """The members' URLs."""
        return [m.url for m in self.members]

    def form(self) -> dict[str, str]:
        """Rendezvous with every server; returns {url: error} of servers that failed to join."""
        port = free_port(self.master_address)  # a fresh port per group: no stale keys
        futures = {m.url: self.fleet.submit(m.url, lambda c, m=m: weight_calls(c).init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=m.rank_offset,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend))
            for m in self.members}
        try:
            self.group = WeightUpdateGroup(master_address=self.master_address, master_port=port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name,
                                           backend=self.backend, timeout_s=self.timeout_s,
                                           device=self.device if self.backend == "nccl" else None)
        except RuntimeError as e:  # some rank never arrived; the HTTP replies say which
            errors = wait_all(futures, self.timeout_s)
            return errors or {url: f"{url}: joining {self.group_name}: {e}" for url in self.urls}
        errors = wait_all(futures, self.timeout_s)
        log.info("stage %d: weight update group %s formed with %d servers (world %d)", self.stage,
                 self.group_name, len(self.members), self.world_size)
        return errors

    def post(self, bucket: Bucket, version: str | None) -> Pending:
        """Announce the bucket to every server and broadcast it; the replies are awaited by ``finish``.

        When this returns the bucket's memory is free to reuse (the broadcast has completed on the
        sending side), so the next bucket can be gathered while the servers install this one.
        """
        assert self.group is not None, "post() before form()"
        meta = bucket.meta()
        futures = {url: self.fleet.submit(url, lambda c: weight_calls(c).update_weights_from_distributed(
            **meta, weight_version=version, group_name=self.group_name, flattened_bucket=bucket.flat,
            lora_scale=bucket.lora_scale,
            timeout_s=self.timeout_s * (len(bucket.payload) + 1))) for url in self.urls}
        try:
            for tensor in bucket.payload:
                self.group.broadcast(tensor, src=0)
        except RuntimeError as e:
            # A peer died or hung. Closing our end wakes the servers still waiting on us, so their
            # replies (and the dead one's connection error or silence) arrive within the timeout.
            log.error("stage %d: broadcast in %s failed: %s", self.stage, self.group_name, e)
            self.close_group()
            return Pending(futures, f"broadcast in {self.group_name} failed: {e}")
        return Pending(futures, None)

    def synchronize(self) -> None:
        """Wait for this group's device work (NCCL); a no-op on gloo, which already blocked."""
        if self.group is not None:
            self.group.synchronize()

    def finish(self, pending: Pending) -> dict[str, str]:
        """The servers' replies to a posted bucket: {url: error} of those that failed or hung."""
        errors = wait_all(pending.futures, self.timeout_s)
        if pending.broadcast_error and not errors:
            return {url: f"{url}: {pending.broadcast_error}" for url in self.urls}
        return errors

    def send(self, bucket: Bucket, version: str | None) -> dict[str, str]:
        """Push one bucket to every member and wait for their replies; returns {url: error} of those that failed."""
        return self.finish(self.post(bucket, version))

    def close_group(self) -> None:
        """Destroy this side of the group."""
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def destroy(self, live: list[str]) -> None:
        """Tear down our end and ask the servers still alive to drop theirs (best effort)."""
        self.close_group()
        urls = [u for u in self.urls if u in live]
        start = time.monotonic()
        errors = self.fleet.each(urls, lambda c: weight_calls(c).destroy_weights_update_group(self.group_name),
                                timeout_s=min(self.timeout_s, 30.0))
        for message in errors.values():
            log.warning("stage %d: destroying %s: %s", self.stage, self.group_name, message)
        log.debug("stage %d: %s destroyed in %.2fs", self.stage, self.group_name, time.monotonic() - start)
