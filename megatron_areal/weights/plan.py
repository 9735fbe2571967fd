"""The transfer plan: which trainer rank sends which slice of which HF tensor to which server rank.

A pure function of the trainer's layout (TP, PP, DP, EP, expert TP), the servers' layout (how many,
TP per server) and the model (``model/mapping.py`` through ``model/slices.py``). Every trainer rank
sends what it holds itself, so no rank gathers a stage:

- a TP-split parameter: each TP rank its own shard (a range of rows or columns of each HF tensor,
  ``slices.shard_slices``);
- a replicated one (norms, the router): one TP rank, the least loaded so far;
- an expert: the ranks that hold it, each its expert-TP shard.

The data-parallel replicas hold the same weights, so they share the servers: server ``s`` is served
by replica ``s % dp`` (experts: by expert-data-parallel copy ``s % edp``), and with as many servers as
replicas every trainer rank sends about the same number of bytes.

A server rank needs either whole tensors (``ServerLayout.sharded`` false: the embedded server, vLLM
workers, whose loader shards for itself) or its own TP range of each split tensor (true: the layout a
TP server keeps). A transfer is a sender's slice narrowed to a receiver's need; the plan's tests
check that every element of every server tensor arrives exactly once.

Ranks are Megatron's order ``tp-cp-ep-dp-pp`` (``actor/parallel.py``): within a stage the rank is
``tp_rank + tp * dp_rank``, and for experts ``etp_rank + etp * (ep_rank + ep * edp_rank)``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from megatron_areal.model import mapping
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.slices import HFSlice, even_range, shard_slices


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer's ranks hold the model."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.ep, self.etp) < 1 or (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"trainer layout {self}: ep x etp must divide tp x dp")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> int:
        return pp_rank * self.tp * self.dp + dp_rank * self.tp + tp_rank

    def expert_rank(self, pp_rank: int, ep_rank: int, etp_rank: int, edp_rank: int = 0) -> int:
        return pp_rank * self.tp * self.dp + etp_rank + self.etp * (ep_rank + self.ep * edp_rank)

    def shard_of(self, rank: int, expert: bool) -> tuple[int, int]:
        """(shard index, shard count) of what ``rank`` holds of a split parameter: its TP rank of ``tp``,
        or for an expert its expert-TP rank of ``etp``."""
        inner = rank % (self.tp * self.dp)
        return (inner % self.etp, self.etp) if expert else (inner % self.tp, self.tp)

    def describe(self, rank: int) -> str:
        """``rank 5 (pp1 tp1 dp0)``: a rank with its coordinates, for messages."""
        stage, inner = divmod(rank, self.tp * self.dp)
        return f"trainer rank {rank} (pp{stage} tp{inner % self.tp} dp{inner // self.tp})"


@dataclass(frozen=True)
class ServerLayout:
    """The rollout servers: ``count`` of them with ``tp`` ranks each."""

    count: int
    tp: int = 1
    sharded: bool = False  # each rank needs only its TP range of split tensors (else whole tensors)

    @property
    def receivers(self) -> list[tuple[int, int]]:
        """(server, rank within it) of every receiving rank."""
        return [(s, r) for s in range(self.count) for r in range(self.tp)]


@dataclass(frozen=True)
class Piece:
    """What one trainer rank of replica 0 sends of one Megatron parameter: one HF slice (the same rank
    of another replica sends it to that replica's servers, ``TransferPlan.sender_for``)."""

    sender: int
    source: str  # the global Megatron parameter it is cut from
    slice: HFSlice
    expert: bool = False


@dataclass(frozen=True)
class Transfer:
    """A piece narrowed to what one server rank needs of it."""

    sender: int
    receiver: tuple[int, int]  # (server, rank)
    source: str
    slice: HFSlice


@dataclass
class TransferPlan:
    """The pieces every sender sends and the servers' needs; transfers are computed per receiver."""

    arch: ModelArch
    trainer: TrainerLayout
    servers: ServerLayout
    pieces: list[Piece]
    split_dims: dict[str, int | None] = field(default_factory=dict)  # HF name -> TP dim (None: replicated)
    dtype_bytes: int = 2

    @property
    def senders(self) -> list[int]:
        """The trainer ranks with something to send, ascending."""
        return sorted({self.sender_for(p, s) for p in self.pieces for s in range(self.servers.count)})

    def sender_for(self, piece: Piece, server: int) -> int:
        """Which copy of ``piece``'s sender serves ``server``: replica ``server % dp`` (experts: copy ``% edp``)."""
        t = self.trainer
        if piece.expert:
            edp = t.tp * t.dp // (t.ep * t.etp)
            return piece.sender + (server % edp) * t.etp * t.ep
        return piece.sender + (server % t.dp) * t.tp

    def need(self, hf: HFSlice, rank: int) -> tuple[int, int]:
        """The range of ``hf``'s split dimension a server rank needs."""
        dim = self.split_dims.get(hf.name)
        if not self.servers.sharded or dim is None or self.servers.tp == 1:
            return 0, hf.shape[hf.dim]
        return even_range(hf.shape[hf.dim], rank, self.servers.tp)

    def transfers_to(self, receiver: tuple[int, int]) -> Iterator[Transfer]:
        """What ``receiver`` gets, in the senders' order."""
        for p in self.pieces:
            part = p.slice.narrow(*self.need(p.slice, receiver[1]))
            if part.numel:
                yield Transfer(self.sender_for(p, receiver[0]), receiver, p.source, part)

    def bytes_per_sender(self) -> dict[int, int]:
        """Bytes each trainer rank puts on the wire in one push (to all receivers), every rank listed."""
        out = dict.fromkeys(range(self.trainer.world), 0)
        per_rank = [sum(p.slice.narrow(*self.need(p.slice, r)).numel for r in range(self.servers.tp))
                    for p in self.pieces]
        for p, n in zip(self.pieces, per_rank, strict=True):
            for server in range(self.servers.count):
                out[self.sender_for(p, server)] += n * self.dtype_bytes
        return out

    def busiest_share(self) -> float:
        """Bytes of the busiest trainer rank over the mean per trainer rank (1.0: perfectly even)."""
        sent = self.bytes_per_sender()
        mean = sum(sent.values()) / len(sent)
        return max(sent.values()) / mean if mean else 0.0

    def summary(self) -> str:
        """A few lines for ``--dry-run``: layout, bytes, the busiest rank's share."""
        sent = self.bytes_per_sender()
        total, busiest = sum(sent.values()), max(sent, key=sent.get)
        t, s = self.trainer, self.servers
        return "\n".join([
            f"weight push plan: trainer tp={t.tp} pp={t.pp} dp={t.dp} ep={t.ep} etp={t.etp} -> {s.count} servers "
            f"x tp={s.tp} ({'sharded' if s.sharded else 'whole tensors'} per rank)",
            f"  {len(self.pieces)} slices from {len(self.senders)} of {t.world} trainer ranks, "
            f"{total / 2**30:.2f} GiB on the wire per push",
            f"  busiest: {t.describe(busiest)} {sent[busiest] / 2**30:.2f} GiB = {self.busiest_share():.2f} x the mean "
            f"(a stage-head push: {stage_head_share(t):.2f})"])


def stage_head_share(trainer: TrainerLayout) -> float:
    """The busiest share when every byte leaves its stage's head (the path SGLang gets): world / pp."""
    return trainer.world / trainer.pp


def stage_of(arch: ModelArch, name: str, pp: int) -> int:
    """The pipeline stage holding the Megatron parameter ``name`` (layers split evenly, as ``actor/model.py``)."""
    name = mapping.canonical(name)
    if name == "embedding.word_embeddings.weight":
        return 0
    if name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        return pp - 1
    return int(name.split(".")[2]) // (arch.num_layers // pp)


def make_plan(arch: ModelArch, trainer: TrainerLayout, servers: ServerLayout, *,
              dtype_bytes: int = 2) -> TransferPlan:
    """The plan of one push (see the module's docstring); deterministic, so every rank computes the same."""
    if arch.num_layers % trainer.pp:
        raise ValueError(f"pp={trainer.pp} must divide the model's {arch.num_layers} layers")
    mapping.check_ep(arch, trainer.ep, trainer.etp)
    load: dict[int, int] = defaultdict(int)
    pieces: list[Piece] = []
    split_dims: dict[str, int | None] = {}
    per_ep = arch.num_experts // trainer.ep if arch.is_moe else 0
    for name in mapping.mcore_names(arch):
        if arch.tie_word_embeddings and name == "output_layer.weight":
            continue
        stage = stage_of(arch, name, trainer.pp)
        dim = mapping.tp_dim(name)
        expert = mapping.expert_index(name)
        if expert is not None:
            owners = [(trainer.expert_rank(stage, expert // per_ep, j), j, trainer.etp) for j in range(trainer.etp)]
        elif dim is not None:
            owners = [(trainer.rank(stage, t), t, trainer.tp) for t in range(trainer.tp)]
        else:  # replicated: the least loaded TP rank of replica 0 (the lowest on a tie)
            owners = [(min((trainer.rank(stage, t) for t in range(trainer.tp)), key=lambda r: (load[r], r)), 0, 1)]
        for rank, shard, size in owners:
            for hf in shard_slices(arch, name, shard, size):
                split_dims[hf.name] = dim
                pieces.append(Piece(rank, name, hf, expert is not None))
                load[rank] += hf.numel
    return TransferPlan(arch, trainer, servers, pieces, split_dims, dtype_bytes)
