"""One pipeline stage's weight-update groups: the stage head (rank 0) with each server's ranks, one group per
server.

In each group the server joins with ``rank_offset = 1`` (its TP ranks are 1..tp). A group is formed
while its ``/init_weights_update_group`` call is in flight (the server's ranks and the head rendezvous at
the head's store), and each bucket is broadcast while its ``/update_weights_from_distributed`` request is
pending, as the protocol requires.

Why a group per server and not one per stage with every server in it: a server takes one weight
operation at a time, in arrival order, and a broadcast needs every member. With one group per stage, two
stages streaming at once can deadlock (server A inside stage 0's broadcast waits for B, which is inside
stage 1's and waits for A). With a group per (stage, server) a broadcast waits for one server only, and
the head announces a bucket to a server just before it broadcasts to it; so whatever a server is
working on, that operation's head is at it or on its way to it, and every stage's head streams at once.
The price: the head sends a bucket once per server, where one broadcast tree (NCCL's ring) could send it
once in all.
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


class ServerLink:
    """The head side of one stage's group with one server (the head is rank 0, the server ranks 1..tp)."""

    def __init__(self, fleet: Fleet, url: str, tp: int, *, stage: int, group_name: str, master_address: str,
                 backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.fleet, self.url, self.tp, self.stage, self.timeout_s = fleet, url, tp, stage, timeout_s
        self.group_name, self.world_size = group_name, 1 + tp
        self.master_address, self.backend, self.device = master_address, backend, device
        self.group: WeightUpdateGroup | None = None

    def form(self) -> str | None:
        """Rendezvous with the server; what failed, or None."""
        port = free_port(self.master_address)  # a fresh port per group: no stale keys
        future = self.fleet.submit(self.url, lambda c: weight_calls(c).init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=1, world_size=self.world_size,
            group_name=self.group_name, backend=self.backend))
        try:
            self.group = WeightUpdateGroup(master_address=self.master_address, master_port=port, rank=0,
                                           world_size=self.world_size, group_name=self.group_name,
                                           backend=self.backend, timeout_s=self.timeout_s,
                                           device=self.device if self.backend == "nccl" else None)
        except RuntimeError as e:  # the server never arrived; its HTTP reply may say why
            errors = wait_all({self.url: future}, self.timeout_s)
            return errors.get(self.url) or f"{self.url}: joining {self.group_name}: {e}"
        return wait_all({self.url: future}, self.timeout_s).get(self.url)

    def post(self, bucket: Bucket, version: str | None) -> tuple[cf.Future, str | None]:
        """Announce the bucket to the server and broadcast it: (the reply to come, what failed broadcasting)."""
        assert self.group is not None, "post() before form()"
        meta = bucket.meta()
        future = self.fleet.submit(self.url, lambda c: weight_calls(c).update_weights_from_distributed(
            **meta, weight_version=version, group_name=self.group_name, flattened_bucket=bucket.flat,
            timeout_s=self.timeout_s * (len(bucket.payload) + 1)))
        try:
            for tensor in bucket.payload:
                self.group.broadcast(tensor, src=0)
        except RuntimeError as e:
            # The server died or hung. Closing our end wakes its ranks still waiting on us, so its
            # reply (or its connection error, or silence) arrives within the timeout.
            log.error("stage %d: broadcast in %s failed: %s", self.stage, self.group_name, e)
            self.close_group()
            return future, f"broadcast in {self.group_name} failed: {e}"
        return future, None

    def close_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class StageLink:
    """The head side of one stage's groups with a fixed set of servers, one group each (``ServerLink``)."""

    def __init__(self, fleet: Fleet, servers: dict[str, int], *, stage: int, generation: int,
                 master_address: str, backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.fleet, self.stage, self.timeout_s = fleet, stage, timeout_s
        # names unique per stage, server and generation: a server holds every stage's group at once
        self.links = [ServerLink(fleet, url, tp, stage=stage, group_name=f"weights-stage{stage}-s{i}-gen{generation}",
                                 master_address=master_address, backend=backend, timeout_s=timeout_s, device=device)
                      for i, (url, tp) in enumerate(servers.items())]

    @property
    def urls(self) -> list[str]:
        """The members' URLs."""
        return [link.url for link in self.links]

    def form(self) -> dict[str, str]:
        """Rendezvous with every server, one after another; returns {url: error} of servers that failed to join."""
        errors = {}
        for link in self.links:
            error = link.form()
            if error is not None:
                errors[link.url] = error
        if not errors:
            log.info("stage %d: weight update groups formed with %d servers", self.stage, len(self.links))
        return errors

    def post(self, bucket: Bucket, version: str | None) -> Pending:
        """Announce the bucket to each server and broadcast it to it, one server after another; the replies
        are awaited by ``finish``.

        When this returns the bucket's memory is free to reuse (the broadcasts have completed on the
        sending side), so the next bucket can be gathered while the servers install this one.
        """
        futures, failed = {}, {}
        for link in self.links:
            futures[link.url], error = link.post(bucket, version)
            if error is not None:
                failed[link.url] = error
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
        names = {link.url: link.group_name for link in self.links if link.url in live}
        start = time.monotonic()
        futures = {url: self.fleet.submit(url, lambda c, name=name: weight_calls(c).destroy_weights_update_group(name))
                   for url, name in names.items()}
        for url, message in wait_all(futures, min(self.timeout_s, 30.0)).items():
            log.warning("stage %d: destroying %s: %s", self.stage, names[url], message)
        log.debug("stage %d: groups destroyed in %.2fs", self.stage, time.monotonic() - start)
