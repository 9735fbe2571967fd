"""The price of one weight push, from its transfer plan (``weights/plan.py``): bytes per link, link bandwidths,
buckets overlapped.

Placement: trainer rank ``i`` is GPU ``i``; server ``s``'s rank ``r`` is GPU ``trainer world + s * tp + r``;
GPU ``g`` is on node ``g // gpus_per_node``. Two GPUs on one node talk over NVLink, others over InfiniBand;
a CPU run (``gpus_per_node`` 0) talks over gloo. Each rank's NIC moves its bytes one after another, so a
rank's wire time is the sum of its transfers' bytes over their links' bandwidths, as a sender and as a
receiver; the push ends when the busiest rank is done.

Overlap: a sender converts and packs bucket k+1 while bucket k is on the wire, so its time is the longer of
converting and sending plus one bucket of the other (the pipeline's fill). Two paths:

- shard to shard (``stage_head=False``): every trainer rank sends its own pieces point to point to the server
  ranks that need them (the plan's transfers);
- stage heads (``stage_head=True``, the path SGLang takes): each stage's head sends its whole stage, as one
  broadcast per bucket to every server rank: a pipelined broadcast puts the stage's bytes once on each link,
  so the head and every receiver move a stage's bytes, whatever the number of trainer ranks.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from megatron_areal.sim.costs import CostModel
from megatron_areal.sim.scenario import CPU_PROCESS, Scenario
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, TransferPlan, make_plan, stage_of

Receiver = tuple[int, int]  # (server, rank within it)


@dataclass(frozen=True)
class Links:
    """Bandwidths in bytes/s (``SimConfig.push_*_gbs`` times ``net_efficiency``)."""

    nvlink: float
    ib: float
    gloo: float
    convert: float  # gather + HF conversion + packing on a sender
    gpus_per_node: int = 8

    def between(self, trainer_world: int, server_tp: int, sender: int, server: int) -> float:
        """The bandwidth from trainer rank ``sender`` to server ``server`` (its ranks share a node)."""
        if self.gpus_per_node == 0:
            return self.gloo
        same = sender // self.gpus_per_node == (trainer_world + server * server_tp) // self.gpus_per_node
        return self.nvlink if same else self.ib


@dataclass(frozen=True)
class PushEstimate:
    """One push as priced: seconds, and what bounds it."""

    seconds: float
    busiest_sender_bytes: int
    busiest_receiver_bytes: int
    bound: str  # the rank whose time is the push's


def rank_seconds(wire_s: float, convert_s: float, fill_s: float) -> float:
    """One rank's time with buckets overlapped: the longer stream plus one bucket of the other."""
    return max(wire_s, convert_s) + min(fill_s, min(wire_s, convert_s))


def price(sent: dict[int, tuple[int, float]], received: dict[Receiver, tuple[int, float]], *, convert: float,
          bucket_bytes: int, bandwidth_of: Callable[[int], float]) -> PushEstimate:
    """The push's seconds from each sender's (bytes, wire seconds) and each receiver's: senders convert their
    bytes at ``convert`` bytes/s overlapped with sending, a bucket at a time (``bandwidth_of(sender)``: its
    slowest link, for the fill); receivers install as the bytes arrive."""
    best, bound = 0.0, "nothing to send"
    for rank, (nbytes, wire) in sent.items():
        t = rank_seconds(wire, nbytes / convert, min(bucket_bytes, nbytes) / bandwidth_of(rank))
        if t > best:
            best, bound = t, f"trainer rank {rank}"
    for (server, r), (_, wire) in received.items():
        if wire > best:
            best, bound = wire, f"server {server} rank {r}"
    return PushEstimate(best, max((b for b, _ in sent.values()), default=0),
                        max((b for b, _ in received.values()), default=0), bound)


def _add(table: dict, key, nbytes: int, seconds: float) -> None:
    b, s = table.get(key, (0, 0.0))
    table[key] = (b + nbytes, s + seconds)


def push_estimate(plan: TransferPlan, links: Links, *, bucket_bytes: int, stage_head: bool = False) -> PushEstimate:
    """The predicted seconds of one push of ``plan`` (see the module's docstring)."""
    t, servers = plan.trainer, plan.servers
    sent: dict[int, tuple[int, float]] = {}
    received: dict[Receiver, tuple[int, float]] = {}
    slowest: dict[int, float] = defaultdict(lambda: float("inf"))
    db = plan.dtype_bytes
    if stage_head:
        stage_bytes: dict[int, int] = defaultdict(int)
        for p in plan.pieces:
            stage_bytes[stage_of(plan.arch, p.source, t.pp)] += p.slice.numel * db
        for stage, nbytes in stage_bytes.items():
            head = t.rank(stage, 0, 0)
            bw = min(links.between(t.world, servers.tp, head, s) for s in range(servers.count))
            slowest[head] = bw
            _add(sent, head, nbytes, nbytes / bw)
            for receiver in servers.receivers:
                _add(received, receiver, nbytes, nbytes / bw)
        return price(sent, received, convert=links.convert, bucket_bytes=bucket_bytes,
                     bandwidth_of=lambda r: slowest[r])
    for p in plan.pieces:
        per_rank = [p.slice.narrow(*plan.need(p.slice, r)).numel * db for r in range(servers.tp)]
        total = sum(per_rank)
        if not total:
            continue
        for s in range(servers.count):
            sender = plan.sender_for(p, s)
            bw = links.between(t.world, servers.tp, sender, s)
            slowest[sender] = min(slowest[sender], bw)
            _add(sent, sender, total, total / bw)
            for r, nbytes in enumerate(per_rank):
                if nbytes:
                    _add(received, (s, r), nbytes, nbytes / bw)
    return price(sent, received, convert=links.convert, bucket_bytes=bucket_bytes, bandwidth_of=lambda r: slowest[r])


_ESTIMATES: dict[tuple, dict[str, PushEstimate]] = {}  # a sweep prices the same layouts again and again


def scenario_estimates(sc: Scenario) -> dict[str, PushEstimate]:
    """A scenario's push priced both ways: ``{"shard_to_shard": ..., "stage_heads": ...}`` (``sim.Scenario``;
    a CPU run's processes talk over gloo)."""
    sim = sc.sim
    key = (repr(sc.model), sc.gpu.name, sc.train_gpus, sc.train_tp, sc.train_pp, sc.train_ep, sc.train_etp,
           sc.n_servers, sc.server_tp, sc.gpus_per_node, sc.push_bucket_bytes, sim.net_efficiency,
           sim.push_nvlink_gbs, sim.push_ib_gbs, sim.push_gloo_gbs, sim.push_convert_gbs)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = _estimates(sc)
    return _ESTIMATES[key]


def update_time(sc: Scenario) -> float:
    """Seconds of one weight update in the event engine: on a GPU cluster with separate trainer and server GPUs,
    the plan's price on the path ``server.engine`` takes plus ``sim.update_overhead_s``; otherwise
    ``CostModel.weight_update_time`` (an on-device copy when colocated; a CPU run's calibrated figure)."""
    if sc.colocated or sc.gpu is CPU_PROCESS:
        return CostModel(sc.model, sc.gpu, sc.sim).weight_update_time(sc.train_pp, sc.colocated)
    path = "stage_heads" if sc.engine == "sglang" else "shard_to_shard"
    return scenario_estimates(sc)[path].seconds + sc.sim.update_overhead_s


def _estimates(sc: Scenario) -> dict[str, PushEstimate]:
    sim = sc.sim
    gbs = 1e9 * sim.net_efficiency
    links = Links(nvlink=sim.push_nvlink_gbs * gbs, ib=sim.push_ib_gbs * gbs, gloo=sim.push_gloo_gbs * gbs,
                  convert=sim.push_convert_gbs * 1e9, gpus_per_node=0 if sc.gpu is CPU_PROCESS else sc.gpus_per_node)
    dp = max(1, sc.train_gpus // (sc.train_tp * sc.train_pp))
    trainer = TrainerLayout(sc.train_tp, sc.train_pp, dp, sc.train_ep, sc.train_etp)
    plan = make_plan(sc.model, trainer, ServerLayout(sc.n_servers, sc.server_tp, sharded=True),
                     dtype_bytes=2 if sc.gpu is not CPU_PROCESS else 4)
    return {"shard_to_shard": push_estimate(plan, links, bucket_bytes=sc.push_bucket_bytes),
            "stage_heads": push_estimate(plan, links, bucket_bytes=sc.push_bucket_bytes, stage_head=True)}


def describe(sc: Scenario, step_time: float) -> str:
    """Lines for ``megatron-areal simulate``: the predicted push seconds of both paths and their share of a step."""
    est = scenario_estimates(sc)
    used = "stage_heads" if sc.engine == "sglang" else "shard_to_shard"
    lines = [f"  weight push          (bucket {sc.push_bucket_bytes / 2**20:.0f} MiB, server.engine={sc.engine} takes "
             f"the {used.replace('_', ' ')} path)"]
    for name, e in est.items():
        mark = "*" if name == used else " "
        lines.append(f"   {mark} {name.replace('_', ' '):15s} {e.seconds:8.2f} s = {100 * e.seconds / step_time:5.2f}% "
                     f"of a step; busiest sender {e.busiest_sender_bytes / 1e9:.2f} GB, busiest receiver "
                     f"{e.busiest_receiver_bytes / 1e9:.2f} GB; bound by {e.bound}")
    return "\n".join(lines)
