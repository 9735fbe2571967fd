"""The stage heads' path (what SGLang takes: whole tensors from one source per group).

Each pipeline stage's head gathers its stage's parameters over TP and the expert ranks
(``gather``), converts and packs them (``buckets``) and broadcasts each bucket to the servers (``link``).
With no more servers than stages every stage streams at once, each head over its own group with each
server, so a server working through the stages' requests in arrival order never waits for another
server (``link`` says why that cannot deadlock) and a push costs the largest stage's time, not the sum.
With more servers, a head sending its stage once per server would send more than any server receives,
so each stage has one group with all the servers and the stages stream in turn. Collective over the
trainer's control group.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.model.arch import ModelArch
from megatron_areal.weights.buckets import adapter_buckets, hf_buckets
from megatron_areal.weights.config import WeightsConfig
from megatron_areal.weights.gather import is_stage_head, takes_part
from megatron_areal.weights.link import Pending, StageLink
from megatron_areal.weights.outcome import Outcome


class StagePush:
    """One trainer rank's part in the stage heads' pushes; the head keeps its stage's group between pushes."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups, *,
                 config: WeightsConfig, fleet: Fleet | None, master_address: str, backend: str,
                 dtype: torch.dtype | None, merge: Callable[[Outcome], Outcome], adapters_only: bool = False) -> None:
        self.adapters_only = adapters_only  # a model.lora run whose servers merge adapters themselves
        self.chunks, self.arch, self.groups, self.config = list(chunks), arch, groups, config
        self.fleet, self.master_address, self.backend, self.dtype = fleet, master_address, backend, dtype
        self.merge = merge  # every rank's outcome, combined on all ranks
        self.is_head = is_stage_head(groups)
        self.link: StageLink | None = None
        self.generation = 0

    def push(self, version: str, servers: dict[str, int], temporary: bool) -> Outcome:
        """Collective: every stage streams to ``servers``, all at once or in turn (``at_once``); a temporary push
        (a server joining) forms its own groups and drops them after."""
        local = Outcome()
        link = None
        together = self.at_once(servers)  # decided once: servers that fail below do not change the groups
        for stage in range(1 if together else self.groups.pp):
            if (together or stage == self.groups.pp_rank) and servers:
                if self.is_head:
                    link, local.errors = self._link_for(servers, temporary, per_server=together)
                if takes_part(self.groups):
                    self._stream(link, version, local)
            if not together and stage < self.groups.pp - 1:
                # later stages leave out the servers that already failed (they would wait for them)
                failed = self.merge(Outcome(errors=dict(local.errors))).errors
                servers = {u: tp for u, tp in servers.items() if u not in failed}
        outcome = self.merge(local)
        if link is not None and (temporary or outcome.errors):
            link.destroy([u for u in servers if u not in outcome.errors])
            if link is self.link:
                self.link = None
        return outcome

    def at_once(self, servers: dict[str, int]) -> bool:
        """Whether the stages stream at the same time, each head over its own group with each server: when there
        are no more servers than stages. Then a head sends its stage once per server, no more than a server
        receives from all stages together. With more servers than stages, one group per stage with every
        server in it lets the broadcast carry a stage's bytes once from its head (NCCL pipelines it through
        the servers), and the stages go in turn (at once they could deadlock: ``link``)."""
        return len(servers) <= self.groups.pp

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
        if self.adapters_only:
            buckets = adapter_buckets(self.chunks, self.groups, bucket_bytes=self.config.bucket_bytes,
                                      flat=self.config.flattened_bucket, device=self.groups.device)
        else:
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

    def _link_for(self, servers: dict[str, int], temporary: bool,
                  per_server: bool) -> tuple[StageLink | None, dict[str, str]]:
        """The stage's groups with exactly ``servers``, formed now unless the current ones match."""
        if not temporary and self.link is not None and self.link.urls == list(servers) \
                and self.link.per_server == per_server:
            return self.link, {}
        if not temporary and self.link is not None:
            self.link.destroy(list(servers))
            self.link = None
        self.generation += 1
        assert self.fleet is not None
        link = StageLink(self.fleet, servers, stage=self.groups.pp_rank, generation=self.generation,
                         master_address=self.master_address, backend=self.backend,
                         timeout_s=self.config.timeout_s, device=self.groups.device, per_server=per_server)
        errors = link.form()
        if errors:
            link.destroy([u for u in servers if u not in errors])
            return None, errors
        if not temporary:
            self.link = link
        return link, {}
