"""``WeightSync``: push the trainer's current weights to every rollout server after a step.

Every trainer rank creates one and calls ``sync(version)`` together (it is collective over the
control group, by default the world). The sequence: rank 0 pauses generation on all servers; the
weights travel (``weights.transfer``): every trainer rank sends its own slices as the transfer plan
says (``shard_push``; the embedded server and vLLM), or each pipeline stage's head gathers its stage
and broadcasts whole tensors (``stage_push``; SGLang); the outcome is agreed on by all ranks; rank 0
continues generation. A server that dies or stops answering is named, dropped, and the transfer is
repeated for the remaining servers, so the run goes on. With ``method="disk"`` the weights travel
through an HF folder on a shared filesystem and ``/update_weights_from_disk`` instead.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.fleet import Fleet, normalize_url, wait_all
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.weights import ADAPTERS, unwrap
from megatron_areal.weights.config import WeightsConfig
from megatron_areal.weights.disk import prune_versions, write_hf_folder
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.gather import check_head_holds_first_experts, is_stage_head
from megatron_areal.weights.outcome import Outcome, combine
from megatron_areal.weights.shard_push import ShardPush
from megatron_areal.weights.stage_push import StagePush

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A transfer that could not complete; the message names the servers and what they said."""


class TransferLost(WeightSyncError):
    """A transfer over NCCL that failed part-way: not retried in this process (NCCL work cannot be
    cancelled from the host); a new attempt resumed from the checkpoint gets past it."""


@dataclass
class SyncResult:
    """One weight push: the version installed, how long it took and where, what was sent, and which servers
    hold it now or were dropped."""

    version: str
    seconds: float
    bytes_sent: int  # HF-layout bytes over all stages (per server)
    buckets: int
    max_bucket_bytes: int
    servers: list[str]  # servers holding ``version`` now
    dropped: dict[str, str] = field(default_factory=dict)  # url -> the error that removed it
    # on the busiest stage head: TP gather + HF conversion + packing, broadcasts, waiting for installs
    gather_seconds: float = 0.0
    broadcast_seconds: float = 0.0
    reply_seconds: float = 0.0
    verified_tensors: int | None = None  # (server, tensor) checksums that agreed; None: weights.verify is off
    wire_bytes: list[int] = field(default_factory=list)  # shard push: bytes each sending trainer rank put on the wire
    peak_buffer_bytes: int = 0  # shard push: the most bucket memory one trainer rank held at once


# engines whose receiving side merges pushed adapters into a kept base (``wire.AdapterMerge``): the embedded
# server and our vLLM weight-transfer plugin; SGLang gets the merged weights
ADAPTER_ENGINES = ("embedded", "vllm")


def pushes_adapters_only(engine: str, method: str, adapters: bool) -> bool:
    """Whether a sync moves only a ``model.lora`` run's ``A`` and ``B`` (the servers merge them)."""
    return adapters and method == "distributed" and engine in ADAPTER_ENGINES


def transfer_of(transfer: str, engine: str, adapters: bool = False) -> str:
    """``weights.transfer`` resolved for ``server.engine``: SGLang takes whole tensors from one source per group.
    A ``model.lora`` run (``adapters``) pushes its adapters (or, to SGLang, merged weights) from the stage heads."""
    if adapters and transfer == "shards":
        raise ValueError("weights.transfer=shards: a model.lora run pushes its adapters (or merged weights) "
                         "from the stage heads; use stage_heads (or auto)")
    if transfer == "auto":
        return "stage_heads" if engine == "sglang" or adapters else "shards"
    if transfer == "shards" and engine == "sglang":
        raise ValueError("weights.transfer=shards: SGLang takes whole tensors from one source per group; "
                         "use stage_heads (or auto)")
    return transfer


async def _restarted(client: RolloutClient, version: str) -> str | None:
    """Why the member at ``client`` was restarted since the sync of weights ``version``, or None.

    Versions we push are integers; a server that answers with a launch label instead (``"default"``,
    SGLang's and ours) is a fresh process on a member's port: it lost the weights and its place in the
    weight group, so it is dropped before the push, and ``readmit`` at the end of the sync takes it back
    with the current weights. One that does not answer within 10 s counts as not restarted (the push finds out)."""
    try:
        label = str(await asyncio.wait_for(client.weight_version(), 10.0))
    except Exception:  # noqa: BLE001 - no answer: taken as not restarted; the push finds out
        return None
    if label != version and not _is_int(label):
        return f"answers with weight version {label!r} instead of {version!r}: it was restarted"
    return None


async def pause_member(client: RolloutClient, mode: str, version: str | None) -> str | None:
    """Pause one server and open its update session. The pause goes first: it proves the server is this run's
    before anything keyed is sent to it (``RolloutClient.pause``). With ``version`` (the last sync's) it then
    asks whether the server was restarted since (``_restarted``): returns why, with no session opened (the
    re-admission pauses it again and pushes it the weights), or None."""
    await client.pause(mode)
    if version is not None and (why := await _restarted(client, version)):
        return why
    await weight_calls(client).begin_weight_update()
    return None


def _is_int(label: str) -> bool:
    try:
        int(label)
    except ValueError:
        return False
    return True


def default_master_address() -> str:
    """This host's address as its resolver gives it (127.0.0.1 when it cannot)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class WeightSync:
    """The trainer's side of the weight push: every rank holds one, ``sync(version)`` is collective.

    Rank 0 pauses the fleet and decides which servers are alive; the ranks push (every rank its own
    slices, or the stage heads their stages; groups are formed once and reused while the members stay
    the same); rank 0 resumes the fleet. ``servers`` is the membership every rank agrees on; rank 0
    drops and re-admits servers in ``fleet`` too (the ``Fleet`` the rollout controller routes over,
    when the trainer shares it), so a dropped server gets no more rollouts; ``SyncResult.dropped`` names the
    servers a sync dropped and ``readmit`` returns the ones taken back.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups,
                 servers: Sequence[str], *, config: WeightsConfig | None = None, server_tp: int = 1,
                 api_key: str | None = None, template_dir: str | Path | None = None,
                 control_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 fleet: Fleet | None = None, engine: str | None = None) -> None:
        self.chunks, self.arch, self.groups = list(chunks), arch, groups
        self.config = config or WeightsConfig()
        self.config.validate()
        if self.config.method == "disk" and template_dir is None:
            raise ValueError("weights.method=disk needs the model folder the servers started from (template_dir) "
                             "for the config and tokenizer files")
        self.server_tp, self.dtype = server_tp, dtype
        self.template_dir = Path(template_dir) if template_dir is not None else None
        self.control_group = control_group
        self.rank0 = dist.get_rank(control_group) == 0
        self.is_head = is_stage_head(groups)
        check_head_holds_first_experts(groups)
        self.servers: dict[str, int] = {normalize_url(u): server_tp for u in servers}
        self.lost: dict[str, int] = {}  # dropped servers (url -> tp): re-admitted when they answer again
        self.readmitted = 0  # how many times a dropped server came back
        self.version: str | None = None
        self.master_address = self.config.master_address or default_master_address()
        self.backend = "nccl" if groups.backend == "nccl" else "gloo"
        # rank 0 may be handed the trainer's shared fleet (closed by its owner); a stage head makes its own
        self._own_fleet = fleet is None
        engine = engine or (fleet.engine if fleet is not None else "embedded")  # server.engine: the client kind
        self.fleet = fleet if fleet is not None else (
            Fleet(api_key=api_key, control_timeout_s=self.config.timeout_s, engine=engine)
            if (self.is_head or self.rank0) else None)
        adapters = any(getattr(unwrap(c), ADAPTERS, None) is not None for c in self.chunks)
        self.adapters_only = pushes_adapters_only(engine, self.config.method, adapters)
        self._stages = StagePush(self.chunks, arch, groups, config=self.config, fleet=self.fleet,
                                 master_address=self.master_address, backend=self.backend, dtype=dtype,
                                 merge=self._merge, adapters_only=self.adapters_only)
        self.transfer = transfer_of(self.config.transfer, engine, adapters=adapters)
        self._shards = ShardPush(
            self.chunks, arch, groups, fleet=self.fleet if self.rank0 else None, control_group=control_group,
            master_address=self.master_address, backend=self.backend, timeout_s=self.config.timeout_s,
            bucket_bytes=self.config.bucket_bytes, in_flight=self.config.buckets_in_flight, dtype=dtype,
            broadcast=self._value_from_rank0) \
            if self.transfer == "shards" and self.config.method == "distributed" else None

    # ---- the public sequence -------------------------------------------------------------
    def sync(self, version: str | int) -> SyncResult:
        """Collective: pause, transfer, set ``version`` on every server, continue."""
        version, start = str(version), time.monotonic()
        dropped = self._pause(list(self.servers), members=True)
        outcome = self._push_until_done(version, dropped)
        verified = self._verify(version) if self.config.verify and self.config.method == "distributed" else None
        self._resume(list(self.servers))
        self.version = version
        self.readmit()
        result = SyncResult(version=version, seconds=time.monotonic() - start, bytes_sent=outcome.bytes_sent,
                            buckets=outcome.buckets, max_bucket_bytes=outcome.max_bucket_bytes,
                            servers=list(self.servers), dropped=dropped, gather_seconds=outcome.gather_seconds,
                            broadcast_seconds=outcome.broadcast_seconds, reply_seconds=outcome.reply_seconds,
                            verified_tensors=verified, wire_bytes=outcome.wire_bytes,
                            peak_buffer_bytes=outcome.peak_buffer_bytes)
        if self.rank0:
            log.info("weights v%s on %d servers in %.2fs (%.1f MB, %d buckets)%s", version, len(self.servers),
                     result.seconds, result.bytes_sent / 1e6, result.buckets,
                     f"; dropped {', '.join(dropped)}" if dropped else "")
        return result

    def _verify(self, version: str) -> int:
        """Collective: the servers' checksums against the trainer's (``verify.verify_push``); a mismatch raises."""
        from megatron_areal.weights.verify import verify_push

        return verify_push(self, version)

    def add_server(self, url: str, tp: int | None = None) -> None:
        """Collective: give a server that joined late the current weights, then make it a member.

        The server is paused until it holds them, so it never serves stale weights. Call it right
        after a sync (the weights pushed are the trainer's current ones, labelled ``self.version``).
        """
        url = normalize_url(url)
        if url in self.servers:
            return
        newcomer = {url: tp or self.server_tp}
        if self.version is not None:
            lost = self._pause([url])
            if lost:
                raise WeightSyncError(f"joining server does not answer: {lost[url]}")
            outcome = self._push(self.version, newcomer, temporary=True)
            if outcome.errors:
                raise WeightSyncError("late server did not take the current weights: "
                                      + "; ".join(outcome.errors.values()))
            self._resume([url])
        # the next sync re-forms the stage groups with the newcomer in them
        self.servers.update(newcomer)
        log.info("server %s joined at weight version %s", url, self.version)

    def readmit(self) -> list[str]:
        """Collective: take back the dropped servers that answer again (say, restarted by the
        launcher on their port), each with the current weights (``add_server``); rank 0 routes to them
        again (``fleet.join``). One that fails to take the weights stays out and is tried at the next call.
        Returns the urls re-admitted."""
        if not self.lost:  # every rank drops and re-admits the same servers: all of them return here
            return []
        back: dict[str, str] = {}
        if self.rank0 and self.lost:
            assert self.fleet is not None
            back = {u: "" for u, ok in self.fleet.alive(list(self.lost)).items() if ok}
        back = self._from_rank0(back)
        joined = []
        for url in back:
            try:
                self.add_server(url, self.lost[url])
            except WeightSyncError as e:
                log.warning("rollout server %s answers again but could not be re-admitted (tried again at the "
                            "next sync): %s", url, e)
                continue
            self.lost.pop(url, None)
            self.readmitted += 1
            joined.append(url)
            log.warning("rollout server %s re-admitted with weights v%s (%d re-admissions in this run)", url,
                        self.version, self.readmitted)
            if self.rank0:
                self.fleet.join(url)
        return joined

    def close(self) -> None:
        """Destroy the weight-update groups with the servers and close the fleet if it is this object's own."""
        if self._shards is not None:
            self._shards.close(list(self.servers))
        self._stages.close(list(self.servers))
        if self.fleet is not None and self._own_fleet:
            self.fleet.close()
        self.fleet = None

    # ---- steps (each collective over the control group) ----------------------------------
    def _pause(self, urls: list[str], members: bool = False) -> dict[str, str]:
        """Rank 0 pauses the servers and opens their update sessions, one fan-out (``pause_member``); the dead
        are dropped, and with ``members`` those restarted since the last sync. Returns {url: why} of the dropped."""
        errors: dict[str, str] = {}
        restarted: dict[str, str] = {}
        if self.rank0:
            assert self.fleet is not None
            mode, version = self.config.pause_mode, self.version if members else None

            async def pause_and_begin(c: RolloutClient, url: str) -> None:  # each server in its own time
                if why := await pause_member(c, mode, version):
                    restarted[url] = why

            futures = {u: self.fleet.submit(u, lambda c, u=u: pause_and_begin(c, u)) for u in urls}
            errors = wait_all(futures, self.fleet.timeout_s)
        return self._drop_dead(errors, restarted)

    def _resume(self, urls: list[str]) -> None:
        if self.rank0 and urls:
            assert self.fleet is not None

            async def end_and_resume(c: RolloutClient) -> None:
                try:
                    await weight_calls(c).end_weight_update()
                finally:  # generation continues even where the session could not be closed
                    await c.resume()

            for message in self.fleet.each(urls, end_and_resume).values():
                # a server lost here is found by the next sync's pause
                log.error("continuing generation failed: %s", message)

    def _push_until_done(self, version: str, dropped: dict[str, str]) -> Outcome:
        for attempt in range(self.config.max_retries + 1):
            outcome = self._push(version, dict(self.servers))
            if not outcome.errors:
                return outcome
            if self.backend == "nccl":
                # NCCL work cannot be cancelled from the host: a receiver lost mid-transfer leaves a
                # broadcast that never completes (the watchdog ends the process). Stop cleanly
                # instead; the trainer checkpoints and a scheduler requeues the run.
                raise TransferLost(f"weights v{version}: transfer over NCCL failed, which is fatal "
                                      "(resume from the checkpoint): " + "; ".join(outcome.errors.values()))
            lost = self._drop_dead(outcome.errors)
            dropped.update(lost)
            refused = {u: m for u, m in outcome.errors.items() if u not in lost}
            # With a server lost, the others' errors may be its doing (a group it never joined):
            # retry without it. Errors from live servers alone are refusals.
            if refused and not lost:
                raise WeightSyncError(f"weights v{version} refused (servers stay paused): "
                                      + "; ".join(refused.values()))
            log.warning("weights v%s: retrying without %s (attempt %d)", version, ", ".join(lost), attempt + 2)
        raise WeightSyncError(f"weights v{version}: servers kept failing: " + "; ".join(dropped.values()))

    def _drop_dead(self, errors: dict[str, str], restarted: dict[str, str] | None = None) -> dict[str, str]:
        """Rank 0 health-checks the servers named in ``errors``; all ranks drop the dead ones and ``restarted``."""
        dead: dict[str, str] = dict(restarted or {})
        if self.rank0 and errors:
            assert self.fleet is not None
            alive = self.fleet.alive(list(errors))  # members, or a server being added
            dead.update({u: errors[u] for u, ok in alive.items() if not ok})
        return self._forget(self._from_rank0(dead))

    def _forget(self, dead: dict[str, str]) -> dict[str, str]:
        """Every rank: drop ``dead`` from the members (rank 0 stops routing to them: ``fleet.drop``); remember
        them for ``readmit``."""
        for url, message in dead.items():
            log.error("dropping rollout server %s: %s", url, message)
            self.lost[url] = self.servers.pop(url, None) or self.lost.get(url) or self.server_tp
            if self.rank0:
                self.fleet.drop(url, message)
        return dead

    def _push(self, version: str, servers: dict[str, int], temporary: bool = False) -> Outcome:
        if self.config.method == "disk":
            return self._push_disk(version, list(servers))
        if self._shards is not None:
            return self._push_shards(version, servers, temporary)
        return self._stages.push(version, servers, temporary)

    def _push_disk(self, version: str, urls: list[str]) -> Outcome:
        assert self.config.disk_dir is not None and self.template_dir is not None
        root = Path(self.config.disk_dir)
        folder = write_hf_folder(self.chunks, self.arch, self.groups, root=root, version=version,
                                 template_dir=self.template_dir, control_group=self.control_group,
                                 dtype=self.dtype)
        local = Outcome()
        if self.rank0:
            assert self.fleet is not None
            local.errors = self.fleet.each(urls, lambda c: weight_calls(c).update_weights_from_disk(
                str(folder), weight_version=version, timeout_s=self.config.timeout_s))
            local.bytes_sent = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            local.buckets = len(list(folder.glob("*.safetensors")))
            local.max_bucket_bytes = local.bytes_sent
            prune_versions(root, keep=folder)
        return self._merge(local)

    def _merge(self, local: Outcome) -> Outcome:
        """Every rank's outcome, combined identically on all ranks."""
        parts: list[Outcome | None] = [None] * dist.get_world_size(self.control_group)
        dist.all_gather_object(parts, local, group=self.control_group)
        return combine(p for p in parts if p is not None)

    def _push_shards(self, version: str, servers: dict[str, int], temporary: bool) -> Outcome:
        """Every trainer rank sends its own slices (``shard_push``); the group is re-formed when the members change."""
        shards = self._shards
        assert shards is not None
        if not servers:
            return Outcome()
        if temporary or shards.members != servers:
            formed = self._merge(Outcome(errors=shards.form(servers)))
            if formed.errors:
                shards.close([u for u in servers if u not in formed.errors])
                return formed
        clock = time.perf_counter()
        stats, errors = shards.push(version)
        local = Outcome(errors=errors, bytes_sent=stats.wire_bytes // max(1, len(servers)), buckets=stats.buckets,
                         max_bucket_bytes=self.config.bucket_bytes if stats.buckets else 0,
                         gather_seconds=stats.pack_seconds,
                         broadcast_seconds=stats.wait_seconds, reply_seconds=time.perf_counter() - clock,
                         wire_bytes=[stats.wire_bytes], peak_buffer_bytes=stats.peak_buffer_bytes)
        outcome = self._merge(local)
        if temporary or outcome.errors:  # a server that reported an error may still hold the group: tell all
            shards.close(list(servers))
        return outcome

    def _value_from_rank0(self, value: object) -> object:
        box = [value]
        dist.broadcast_object_list(box, group=self.control_group, group_src=0)
        return box[0]

    def _from_rank0(self, value: dict[str, str]) -> dict[str, str]:
        box: list[dict[str, str]] = [value]
        dist.broadcast_object_list(box, group=self.control_group, group_src=0)
        return box[0]
