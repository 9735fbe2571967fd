"""The stage heads' path (what SGLang takes: whole tensors from one source per group).

Each pipeline stage's head gathers its stage's parameters over TP and the expert ranks
(``gather``), converts and packs them (``buckets``) and broadcasts each bucket over its own group with
each server (``link``). All stages stream at once: a group holds one head and one server, so a server
working through the stages' requests in arrival order never waits for another server (``link`` says why
that cannot deadlock), and a push costs the largest stage's time, not the sum. Collective over the
trainer's control group.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.model.arch import ModelArch
from megatron_areal.weights.buckets import hf_buckets
from megatron_areal.weights.config import WeightsConfig
from megatron_areal.weights.gather import is_stage_head, takes_part
from megatron_areal.weights.link import Pending, StageLink
from megatron_areal.weights.outcome import Outcome


class StagePush:
    """One trainer rank's part in the stage heads' pushes; the head keeps its stage's group between pushes."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *,
                 config: WeightsConfig, fleet: Fleet | None, master_address: str, backend: str,
                 dtype: torch.dtype | None, merge: Callable[[Outcome], Outcome]) -> None:
        self.chunks, self.arch, self.groups, self.config = list(chunks), arch, groups, config
        self.fleet, self.master_address, self.backend, self.dtype = fleet, master_address, backend, dtype
        self.merge = merge  # every rank's outcome, combined on all ranks
        self.is_head = is_stage_head(groups)
        self.link: StageLink | None = None
        self.generation = 0

    def push(self, version: str, servers: dict[str, int], temporary: bool) -> Outcome:
        """Collective: every stage streams to ``servers`` at once; a temporary push (a server joining) forms its
        own groups and drops them after."""
        local = Outcome()
        link = None
        if servers:
            if self.is_head:
                link, local.errors = self._link_for(servers, temporary)
            if takes_part(self.groups):
                self._stream(link, version, local)
        outcome = self.merge(local)
        if link is not None and (temporary or outcome.errors):
            link.destroy([u for u in servers if u not in outcome.errors])
            if link is self.link:
                self.link = None
        return outcome

    def close(self, live: list[str]) -> None:
        if self.link is not None:
            self.link.destroy(live)
            self.link = None

    def _stream(self, link: StageLink | None, version: str, local: Outcome) -> None:
        """Gather, convert and send this stage's buckets; TP peers and expert ranks only take part in the gathers.

        The servers install bucket k while bucket k+1 is being gathered; their replies to k are
        awaited before k+1 is announced, so each group sees one request at a time.
        """
        pending = None
        buckets = hf_buckets(self.chunks, self.arch, self.groups, bucket_bytes=self.config.bucket_bytes,
                             flat=self.config.flattened_bucket, dtype=self.dtype, device=self.groups.device)
        clock = time.perf_counter()
        for bucket in buckets:
            local.gather_seconds += time.perf_counter() - clock
            if pending is not None:
                local.errors, pending = self._finish(link, pending, local), None
            if local.errors or link is None:
                clock = time.perf_counter()
                continue  # keep gathering in step with the TP peers, send nothing more
            clock = time.perf_counter()
            pending = link.post(bucket, version)
            link.synchronize()  # NCCL returns before the bytes have moved; time the transfer itself
            local.broadcast_seconds += time.perf_counter() - clock
            local.buckets += 1
            local.bytes_sent += bucket.nbytes
            local.max_bucket_bytes = max(local.max_bucket_bytes, bucket.nbytes)
            clock = time.perf_counter()
        local.gather_seconds += time.perf_counter() - clock
        if pending is not None:
            local.errors = self._finish(link, pending, local)

    @staticmethod
    def _finish(link: StageLink | None, pending: Pending, local: Outcome) -> dict[str, str]:
        assert link is not None
        clock = time.perf_counter()
        errors = link.finish(pending)
        local.reply_seconds += time.perf_counter() - clock
        return errors

    def _link_for(self, servers: dict[str, int], temporary: bool) -> tuple[StageLink | None, dict[str, str]]:
        """The stage's group with exactly ``servers``, formed now unless the current one matches."""
        if not temporary and self.link is not None and self.link.urls == list(servers):
            return self.link, {}
        if not temporary and self.link is not None:
            self.link.destroy(list(servers))
            self.link = None
        self.generation += 1
        assert self.fleet is not None
        link = StageLink(self.fleet, servers, stage=self.groups.pp_rank, generation=self.generation,
                         master_address=self.master_address, backend=self.backend,
                         timeout_s=self.config.timeout_s, device=self.groups.device)
        errors = link.form()
        if errors:
            link.destroy([u for u in servers if u not in errors])
            return None, errors
        if not temporary:
            self.link = link
        return link, {}
