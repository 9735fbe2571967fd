"""One pipeline stage's weight-update groups with the servers: the stage head is rank 0 of each; a server
joins with ``rank_offset = 1 + the TP sizes of the servers before it in the group``. A group is formed while
its ``/init_weights_update_group`` calls are in flight (the servers' ranks and the head rendezvous at the
head's store), and each bucket is broadcast while its ``/update_weights_from_distributed`` requests are
pending, as the protocol requires.

A server takes one weight operation at a time, in arrival order, and a broadcast needs every member. With
one group per stage holding every server, two stages streaming at once can deadlock (server A inside stage
0's broadcast waits for B, which is inside stage 1's and waits for A), so such stages go in turn. With a
group per (stage, server) (``per_server``) a broadcast waits for one server only, and the head announces a
bucket to a server just before it broadcasts to it; so whatever a server is working on, that operation's
head is at it or on its way to it, and every stage's head can stream at once. The price: the head sends a
bucket once per server, where one broadcast (NCCL pipelines it through the members) sends it once in all
(``stage_push.StagePush.at_once`` picks).
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
    """A bucket whose broadcasts are done and whose HTTP replies may still be on the way."""

    futures: dict[str, cf.Future]
    broadcast_errors: dict[str, str]  # url -> what failed while broadcasting to it


class GroupLink:
    """The head side of one group: the head is rank 0, server ``i``'s ranks follow the servers before it
    (``rank_offset = 1 + sum of their TP sizes``)."""

    def __init__(self, fleet: Fleet, servers: dict[str, int], *, stage: int, group_name: str, master_address: str,
                 backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.fleet, self.stage, self.timeout_s = fleet, stage, timeout_s
        self.offsets, offset = {}, 1
        for url, tp in servers.items():
            self.offsets[url] = offset
            offset += tp
        self.group_name, self.world_size = group_name, offset
        self.master_address, self.backend, self.device = master_address, backend, device
        self.group: WeightUpdateGroup | None = None

    def form(self) -> dict[str, str]:
        """Rendezvous with the servers; {url: error} of those that failed to join."""
        port = free_port(self.master_address)  # a fresh port per group: no stale keys
        futures = {url: self.fleet.submit(url, lambda c, o=o: weight_calls(c).init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=o, world_size=self.world_size,
            group_name=self.group_name, backend=self.backend)) for url, o in self.offsets.items()}
        try:
            self.group = WeightUpdateGroup(master_address=self.master_address, master_port=port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name,
                                           backend=self.backend, timeout_s=self.timeout_s,
                                           device=self.device if self.backend == "nccl" else None)
        except RuntimeError as e:  # some rank never arrived; the HTTP replies say which
            errors = wait_all(futures, self.timeout_s)
            return errors or {url: f"{url}: joining {self.group_name}: {e}" for url in self.offsets}
        return wait_all(futures, self.timeout_s)

    def post(self, bucket: Bucket, version: str | None) -> tuple[dict[str, cf.Future], str | None]:
        """Announce the bucket to the servers and broadcast it: (the replies to come, what failed broadcasting)."""
        assert self.group is not None, "post() before form()"
        meta = bucket.meta()
        futures = {url: self.fleet.submit(url, lambda c: weight_calls(c).update_weights_from_distributed(
            **meta, weight_version=version, group_name=self.group_name, flattened_bucket=bucket.flat,
            lora_scale=bucket.lora_scale,
            timeout_s=self.timeout_s * (len(bucket.payload) + 1))) for url in self.offsets}
        try:
            for tensor in bucket.payload:
                self.group.broadcast(tensor, src=0)
        except RuntimeError as e:
            # A server died or hung. Closing our end wakes the ranks still waiting on us, so their
            # replies (or a connection error, or silence) arrive within the timeout.
            log.error("stage %d: broadcast in %s failed: %s", self.stage, self.group_name, e)
            self.close_group()
            return futures, f"broadcast in {self.group_name} failed: {e}"
        return futures, None

    def close_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class StageLink:
    """The head side of one stage's groups with a fixed set of servers: one group with each server
    (``per_server``; the stages can stream at once) or one group with them all (the stages stream in turn)."""

    def __init__(self, fleet: Fleet, servers: dict[str, int], *, stage: int, generation: int,
                 master_address: str, backend: str, timeout_s: float, device: torch.device | None = None,
                 per_server: bool = False) -> None:
        self.fleet, self.stage, self.timeout_s = fleet, stage, timeout_s
        self.servers, self.per_server = list(servers), per_server
        parts = [{url: tp} for url, tp in servers.items()] if per_server else [dict(servers)]
        # names unique per stage, group and generation: a server holds every stage's group at once
        self.links = [GroupLink(fleet, part, stage=stage, group_name=f"weights-stage{stage}-g{i}-gen{generation}",
                                master_address=master_address, backend=backend, timeout_s=timeout_s, device=device)
                      for i, part in enumerate(parts)]

    @property
    def urls(self) -> list[str]:
        """The members' URLs."""
        return list(self.servers)

    def form(self) -> dict[str, str]:
        """Rendezvous with every server, one group after another; returns {url: error} of servers that failed
        to join."""
        errors: dict[str, str] = {}
        for link in self.links:
            errors.update(link.form())
        if not errors:
            log.info("stage %d: weight update groups formed with %d servers", self.stage, len(self.links))
        return errors

    def post(self, bucket: Bucket, version: str | None) -> Pending:
        """Announce the bucket and broadcast it in each group, one group after another; the replies are
        awaited by ``finish``.

        When this returns the bucket's memory is free to reuse (the broadcasts have completed on the
        sending side), so the next bucket can be gathered while the servers install this one.
        """
        futures, failed = {}, {}
        for link in self.links:
            replies, error = link.post(bucket, version)
            futures.update(replies)
            if error is not None:
                failed.update({url: error for url in replies})
        return Pending(futures, failed)

    def synchronize(self) -> None:
        """Wait for the groups' device work (NCCL); a no-op on gloo, which already blocked."""
        for link in self.links:
            if link.group is not None:
                link.group.synchronize()

    def finish(self, pending: Pending) -> dict[str, str]:
        """The servers' replies to a posted bucket: {url: error} of those that failed or hung."""
        errors = wait_all(pending.futures, self.timeout_s)
        for url, error in pending.broadcast_errors.items():
            errors.setdefault(url, f"{url}: {error}")
        return errors

    def send(self, bucket: Bucket, version: str | None) -> dict[str, str]:
        """Push one bucket to every member and wait for their replies; returns {url: error} of those that failed."""
        return self.finish(self.post(bucket, version))

    def close_group(self) -> None:
        """Destroy this side of the groups."""
        for link in self.links:
            link.close_group()

    def destroy(self, live: list[str]) -> None:
        """Tear down our ends and ask the servers still alive to drop theirs (best effort)."""
        self.close_group()
        names = {url: link.group_name for link in self.links for url in link.offsets if url in live}
        start = time.monotonic()
        futures = {url: self.fleet.submit(url, lambda c, name=name: weight_calls(c).destroy_weights_update_group(name))
                   for url, name in names.items()}
        for url, message in wait_all(futures, min(self.timeout_s, 30.0)).items():
            log.warning("stage %d: destroying %s: %s", self.stage, names[url], message)
        log.debug("stage %d: groups destroyed in %.2fs", self.stage, time.monotonic() - start)
