"""Verifying a push (``weights.verify``): every server's checksum of every tensor it installed against the trainer's.

The trainer's checksum of an HF tensor is computed where its pieces live, by the ranks that send them
(``plan.make_plan``'s pieces: each rank its own TP or expert shard, in the HF layout, through
``model/slices.shard_tensors``), and the parts are added up on rank 0: the checksum is a sum over the
tensor's lanes (``wire.slice_sum``), so no rank gathers a tensor, let alone a stage, to verify.

Each part is taken of the values the server holds: the trainer's tensor cast to the dtype it was pushed in,
then to the dtype the server reports for that tensor (a float32 server holding a bfloat16 push holds the
bfloat16 values widened).

Servers: the embedded server answers ``wire.CHECKSUM_ROUTE?kind=slice_sum``. SGLang 0.5.23's own
``/weights_checker`` hashes its fused, TP-sharded parameters with a Triton kernel on GPUs, which the trainer
cannot recompute from HF tensors, so ``weights.verify`` is refused for it at load (``config.py``). vLLM's
``/weight_checker`` is a sha256 per vLLM parameter; its CPU build empties the weight of every linear layer
into oneDNN's packed copy, so only the embedding, the norms and an untied output layer can be compared
there: ``vllm_expected`` computes those from whole tensors on the ranks that hold them whole.
"""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.vllm_client import VLLMClient
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.slices import shard_tensors
from megatron_areal.model.weights import named_global_params
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, TransferPlan, make_plan
from megatron_areal.weights.push import WeightSyncError
from megatron_areal.weights.wire import CHECKSUM_ROUTE, SLICE_SUM, add_sums, format_sum, slice_sum

if TYPE_CHECKING:
    from megatron_areal.weights.push import WeightSync

log = logging.getLogger(__name__)

Sums = tuple[int, int]


class WeightMismatch(WeightSyncError):
    """A server holds a tensor whose checksum is not the trainer's: the push was corrupted."""


def verification_plan(arch: ModelArch, groups: ParallelGroups) -> TransferPlan:
    """The plan whose pieces say which rank checksums which HF slice (one server: only the senders matter)."""
    trainer = TrainerLayout(groups.tp, groups.pp, groups.dp, groups.ep, groups.etp)
    me, mine = dist.get_rank(), trainer.rank(groups.pp_rank, groups.tp_rank, groups.dp_rank)
    if mine != me:
        raise RuntimeError(f"rank {me} is {trainer.describe(mine)} by its groups: the rank order is not "
                           "Megatron's tp-cp-ep-dp-pp")
    return make_plan(arch, trainer, ServerLayout(1))


def _local_slices(chunks: Sequence[torch.nn.Module], arch: ModelArch, plan: TransferPlan, rank: int):
    """(HFSlice, tensor) of every piece this rank sends, in the HF layout (views of its own parameters)."""
    mine = defaultdict(list)
    for piece in plan.pieces:
        if piece.sender == rank:
            mine[piece.source].append(piece)
    for chunk in chunks:
        for name, param in named_global_params(chunk):
            pieces = mine.get(name)
            if not pieces:
                continue
            shard, size = plan.trainer.shard_of(rank, pieces[0].expert)
            wanted = {p.slice.name for p in pieces}
            for hf, tensor in shard_tensors(arch, name, param.detach(), shard, size):
                if hf.name in wanted:
                    yield hf, tensor


@torch.no_grad()
def trainer_sums(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups,
                 server_dtypes: dict[str, str], wire_dtype: torch.dtype | None,
                 control_group: dist.ProcessGroup | None = None) -> dict[str, str] | None:
    """Collective: the trainer's checksum of every HF tensor it pushes, as the servers hold it (``server_dtypes``:
    HF name -> the dtype a server reports), on rank 0 of ``control_group``; None on the other ranks."""
    plan = verification_plan(arch, groups)
    parts: dict[str, Sums] = {}
    for hf, tensor in _local_slices(chunks, arch, plan, dist.get_rank()):
        held = getattr(torch, server_dtypes.get(hf.name, str(tensor.dtype).removeprefix("torch.")))
        values = tensor if wire_dtype is None else tensor.to(wire_dtype)
        parts[hf.name] = add_sums(parts.get(hf.name, (0, 0)), slice_sum(values.to(held), hf.shape, hf.dim, hf.start))
    gathered = _gather_on_first(parts, control_group)
    if gathered is None:
        return None
    total: dict[str, Sums] = {}
    for rank_parts in gathered:
        for name, sums in rank_parts.items():
            total[name] = add_sums(total.get(name, (0, 0)), sums)
    return {name: format_sum(sums) for name, sums in total.items()}


def compare(expected: dict[str, str], reported: dict[str, dict[str, str]], version: str) -> int:
    """The number of (server, tensor) checksums that agree; ``WeightMismatch`` naming the first tensor, server
    and version that does not, or a tensor a server does not report. ``reported``: url -> HF name -> checksum."""
    count = 0
    for url, sums in reported.items():
        for name, want in expected.items():
            got = sums.get(name)
            if got is None:
                raise WeightMismatch(f"weights v{version}: server {url} reports no checksum for {name!r} "
                                     f"(it reports {len(sums)} tensors)")
            if got != want:
                raise WeightMismatch(f"weights v{version}: tensor {name!r} on server {url} has checksum {got}, "
                                     f"the trainer pushed {want}: the push was corrupted")
            count += 1
    return count


def slice_sums_of(reply: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(HF name -> checksum, HF name -> dtype) from an embedded server's ``wire.CHECKSUM_ROUTE?kind=slice_sum``."""
    sums = reply["checksums"]
    return {n: v[SLICE_SUM] for n, v in sums.items()}, {n: v["dtype"] for n, v in sums.items()}


# ---- vLLM ----------------------------------------------------------------------------------------------
VLLM_PREFIX = "dp0:pp0:pcp0:tp0:"  # the first worker's keys in /weight_checker's reply
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # a parameter vLLM's CPU build emptied (packed for oneDNN)
VLLM_VOCAB_PADDING = 64  # vLLM's embedding and output layer rows, zero-filled past the vocabulary
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_comparable(reply: dict[str, str]) -> dict[str, str]:
    """HF name -> sha256 of the tensors a vLLM server's first worker reports with their bytes, by vLLM's
    parameter names (those it shares with HF; fused ones such as ``qkv_proj`` never match an HF name)."""
    return {k.removeprefix(VLLM_PREFIX): v for k, v in reply.items()
            if k.startswith(VLLM_PREFIX) and v != EMPTY_SHA256}


def vllm_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An HF tensor as a vLLM worker at TP 1 holds it: the vocabulary ones padded with zero rows."""
    if name in _VOCAB_TENSORS and tensor.shape[0] % VLLM_VOCAB_PADDING:
        pad = VLLM_VOCAB_PADDING - tensor.shape[0] % VLLM_VOCAB_PADDING
        tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
    return tensor


@torch.no_grad()
def vllm_expected(chunks: Sequence[torch.nn.Module], arch: ModelArch, groups: ParallelGroups,
                  names: set[str], dtype: torch.dtype, server_tp: int,
                  control_group: dist.ProcessGroup | None = None) -> dict[str, str] | None:
    """Collective: sha256 of each HF tensor in ``names`` (cast to ``dtype``, in vLLM's layout) from a rank that
    holds it whole (a replicated parameter, or any at TP 1), on rank 0. With servers at TP > 1 only the tensors
    vLLM does not split (the norms) compare; the others are not verified on vLLM."""
    plan = verification_plan(arch, groups)
    mine = {}
    for hf, tensor in _local_slices(chunks, arch, plan, dist.get_rank()):
        if hf.whole and hf.name in names and (server_tp == 1 or plan.split_dims.get(hf.name) is None):
            data = vllm_layout(hf.name, tensor.to(dtype)).contiguous().cpu().reshape(-1).view(torch.uint8)
            mine[hf.name] = hashlib.sha256(data.numpy()).hexdigest()
    gathered = _gather_on_first(mine, control_group)
    if gathered is None:
        return None
    out: dict[str, str] = {}
    for part in gathered:
        out.update(part)
    return out


# ---- one verification, after a push ---------------------------------------------------------------------
async def _fetch(client: RolloutClient, timeout_s: float) -> tuple[str, dict]:
    """(engine, reply) of a server's checksum route."""
    if isinstance(client, VLLMClient):
        return "vllm", await client.request("POST", "/weight_checker", {"action": "checksum"}, timeout_s)
    return "embedded", await client.request("GET", f"{CHECKSUM_ROUTE}?kind={SLICE_SUM}", None, timeout_s)


def verify_push(sync: WeightSync, version: str) -> int:
    """Collective over ``sync``'s control group, after a push of ``version``: every server's checksums against the
    trainer's; returns how many (server, tensor) pairs agree, raises ``WeightMismatch`` (naming the tensor, the
    server and the version) on every rank when one does not, or when a server does not answer."""
    replies: dict[str, tuple[str, dict]] = {}
    error = ""
    if sync.rank0 and sync.servers:
        assert sync.fleet is not None
        timeout = sync.config.timeout_s
        futures = {u: sync.fleet.submit(u, lambda c: _fetch(c, timeout)) for u in sync.servers}
        for url, future in futures.items():
            try:
                replies[url] = future.result(timeout + 5.0)
            except Exception as e:  # noqa: BLE001 - any failure to answer fails the verification
                error = f"weights v{version}: server {url} did not report its checksums: {e}"
                break
    box = [(replies, error)]
    dist.broadcast_object_list(box, group=sync.control_group, group_src=0)
    replies, error = box[0]
    if error:
        _close_update(sync)
        raise WeightMismatch(error)
    dtype = sync.dtype
    embedded = {u: slice_sums_of(r) for u, (kind, r) in replies.items() if kind == "embedded"}
    vllm = {u: vllm_comparable(r["checksums"]) for u, (kind, r) in replies.items() if kind == "vllm"}
    held: dict[str, str] = {}
    for _, dtypes in embedded.values():
        held.update(dtypes)
    count, outcome = 0, ""
    expected = trainer_sums(sync.chunks, sync.arch, sync.groups, held, dtype, sync.control_group) if embedded else None
    names = set().union(*vllm.values()) if vllm else set()
    wire = dtype or next(p for c in sync.chunks for p in c.parameters()).dtype
    vllm_tp = max((sync.servers.get(u, 1) for u in vllm), default=1)
    digests = vllm_expected(sync.chunks, sync.arch, sync.groups, names, wire, vllm_tp, sync.control_group) \
        if vllm else None
    if sync.rank0:
        try:
            if expected is not None:
                count += compare(expected, {u: sums for u, (sums, _) in embedded.items()}, version)
            if digests is not None:
                count += compare(digests, {u: {n: sums.get(n) for n in digests} for u, sums in vllm.items()}, version)
                log.info("weights v%s on vLLM: %d tensors comparable by /weight_checker (its CPU build reports "
                         "linear layers emptied)", version, len(digests))
        except WeightMismatch as e:
            outcome = str(e)
    box = [(count, outcome)]
    dist.broadcast_object_list(box, group=sync.control_group, group_src=0)
    count, outcome = box[0]
    if outcome:
        _close_update(sync)
        raise WeightMismatch(outcome)
    return count


def _close_update(sync: WeightSync) -> None:
    """Rank 0 ends the servers' weight-update session but leaves them paused: no rollout is generated with the
    weights that failed, and a later push (a resumed run) can open a new session."""
    if sync.rank0 and sync.fleet is not None:
        failed = sync.fleet.each(list(sync.servers), lambda c: weight_calls(c).end_weight_update())
        for message in failed.values():
            log.error("ending the weight update after a failed verification: %s", message)


def _gather_on_first(part: dict, group: dist.ProcessGroup) -> list[dict] | None:
    """Collective: every rank's ``part`` on rank 0 of ``group`` (a list, one per rank); None on the others."""
    first = dist.get_rank(group) == 0
    gathered: list[dict | None] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(part, gathered, group=group, group_dst=0)
    return [g or {} for g in gathered] if gathered is not None else None
