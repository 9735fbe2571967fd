"""The weight-update process group shared by the trainer (rank 0) and the rollout servers.

Both ends must meet under the same store keys, so both build the group exactly as SGLang's
receiving side does (``init_custom_process_group`` in ``sglang/srt/utils/common.py``, the chain
slime and AReaL use on the sending side too): the store of a TCP rendezvous at ``master:port``,
hosted by rank 0 (``rendezvous_store``), a ``PrefixStore(group_name)`` over it, then torch's own
``_new_process_group_helper``, which adds ``"{group_name}/"`` and a per-device prefix before the
backend exchanges its id. A group built any other way waits on different keys and never meets
the servers (tests/test_sglang_conformance.py runs SGLang's function against this one).

The trainer's default (Megatron) process group is not touched: the new group is registered
under its own name with identity rank mapping, as SGLang does. Servers join with
``rank = rank_offset + tp_rank``.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_areal.util.rounding import stochastic_round_

log = logging.getLogger(__name__)
_create_lock = threading.Lock()  # torch's group registry (_world) is a process-wide dict
_joining: set[str] = set()  # group names being joined now (under _create_lock)


class WeightUpdateGroup:
    """A standalone collective group; only broadcast and barrier are needed for weights."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 300.0, device: torch.device | str | None = None) -> None:
        if world_size < 2:
            raise ValueError(f"weight update group {group_name!r}: world size {world_size} has no receiver")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight update group {group_name!r}: rank {rank} outside world of {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight update group {group_name!r}: backend {backend!r} is not gloo or nccl")
        self.rank, self.world_size = rank, world_size
        self.group_name, self.backend = group_name, backend
        self.device = torch.device("cpu")
        if backend == "nccl":
            # Pass the device explicitly from worker threads: their current CUDA device is cuda:0.
            self.device = torch.device(device) if device is not None else \
                torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        log.info("joining weight update group %s at %s:%d as rank %d/%d (%s)", group_name,
                 master_address, master_port, rank, world_size, backend)
        self._pg: dist.ProcessGroup | None = join_group(
            master_address, master_port, rank=rank, world_size=world_size, group_name=group_name,
            backend=backend, timeout=timedelta(seconds=timeout_s))

    @property
    def pg(self) -> dist.ProcessGroup:
        """The process group (raises once destroyed)."""
        if self._pg is None:
            raise RuntimeError(f"weight update group {self.group_name!r} was destroyed")
        return self._pg

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of ``tensor`` from group rank ``src``.

        Blocks the host on gloo. On NCCL it only orders the work on the current stream; call
        ``synchronize`` before timing or reusing memory from another stream.
        """
        dist.broadcast(tensor, group=self.pg, group_src=src)

    def synchronize(self) -> None:
        """Wait until the device has finished this group's work (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Wait until every member reached this point (an all-reduce of one element)."""
        flag = torch.zeros(1, device=self.device)
        dist.all_reduce(flag, group=self.pg)
        self.synchronize()

    def destroy(self) -> None:
        """Release the backend and its registration; the object is unusable afterwards."""
        if self._pg is not None:
            pg, self._pg = self._pg, None
            # Close the connections now: peers still waiting in a collective of this group (after
            # a failed transfer) get an error at once instead of waiting out their timeout.
            pg.shutdown()
            with _create_lock:
                dist.destroy_process_group(pg)


def join_group(master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str,
               backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """Rendezvous and build the group the way SGLang's ``init_custom_process_group`` does.

    Returns once every rank has joined (the backend's id exchange needs all of them); raises
    ``RuntimeError``/``DistStoreError`` after ``timeout`` naming the store otherwise.
    """
    store = dist.PrefixStore(group_name, rendezvous_store(master_address, master_port, rank=rank,
                                                          world_size=world_size, timeout=timeout))
    with _create_lock:
        if group_name in c10d._world.pg_names.values() or group_name in _joining:
            raise ValueError(f"weight update group {group_name!r} already exists in this process")
        _joining.add(group_name)
    # Not under the lock: the backend connects to every member here, and a member may be joining
    # another group first (two stages' groups at once); holding a process-wide lock through the
    # connect would make this process wait for it while it waits for us.
    try:
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                               group_name=group_name, backend_options=None, timeout=timeout)
        with _create_lock:
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    finally:
        with _create_lock:
            _joining.discard(group_name)
    return pg


def rendezvous_store(master_address: str, master_port: int, *, rank: int, world_size: int,
                     timeout: timedelta) -> dist.TCPStore:
    """The store of torch's ``tcp://master:port`` rendezvous (what SGLang's side uses), hosted by rank 0.

    Built directly rather than through ``c10d.rendezvous``: under torchrun (every multi-rank
    trainer) that handler sees ``TORCHELASTIC_USE_AGENT_STORE=True`` and makes every rank a
    client of the launcher agent's store, so nobody would host the weight group's.
    """
    return dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                         multi_tenant=True)


# ---- per-tensor checksums after a push ---------------------------------------------------------------
# A server answers ``GET CHECKSUM_ROUTE?kind=SLICE_SUM`` with ``{"weight_version", "checksums": {hf_name:
# {"slice_sum": hex, "dtype": its dtype, ...}}}`` for every tensor it holds, in the dtype it holds it. The
# checksum is a sum over the tensor's 16-bit lanes (bytes, for 1-byte dtypes) of ``lane * w(i) mod P`` with
# ``w`` a weight of the lane's flat index ``i`` in the whole tensor: a sum, so the trainer adds the parts of
# the slices its ranks hold (``slice_sum``) without gathering a tensor, and a weighted one, so a changed,
# moved or swapped lane changes it (one changed lane always: P is prime and above every lane's value). Two
# weights, linear and quadratic in ``i + 1``, give a 62-bit value.
CHECKSUM_ROUTE = "/weights_checksum"
SLICE_SUM = "slice_sum"
_P = (1 << 31) - 1
_MULTIPLIERS = (48_271, 1_583_458_089)  # primitive roots of P: w1 = m1 (i + 1), w2 = m2 (i + 1)^2, mod P
_CHUNK_LANES = 1 << 22  # bounds the int64 index tensors made per step (32 MiB each)


def slice_sum(part: torch.Tensor, shape: tuple[int, ...] | torch.Size | None = None, dim: int = 0,
              start: int = 0) -> tuple[int, int]:
    """The checksum's two sums over ``part``, which is ``whole.narrow(dim, start, part.shape[dim])`` of a
    tensor of ``shape`` (the whole tensor itself when ``shape`` is None). Computed on ``part``'s device."""
    shape = tuple(part.shape if shape is None else shape)
    if not shape:  # a scalar is a tensor of one element
        part, shape = part.reshape(1), (1,)
    if part.numel() == 0:
        return 0, 0
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    size = part.element_size()
    lanes_per, lane_dtype = (size // 2, torch.int16) if size % 2 == 0 else (size, torch.uint8)
    step = max(1, _CHUNK_LANES // max(1, outer * inner * lanes_per))
    dev = part.device
    sums = [0, 0]
    for j in range(0, part.shape[dim], step):
        sub = part.narrow(dim, j, min(step, part.shape[dim] - j)).contiguous()
        lanes = sub.reshape(-1).view(lane_dtype).to(torch.int64) & (0xFFFF if lane_dtype == torch.int16 else 0xFF)
        rows = start + j + torch.arange(sub.shape[dim], device=dev)
        elem = ((torch.arange(outer, device=dev).view(-1, 1, 1) * shape[dim] + rows.view(1, -1, 1)) * inner
                + torch.arange(inner, device=dev).view(1, 1, -1)).reshape(-1, 1)
        index = (elem * lanes_per + torch.arange(lanes_per, device=dev).view(1, -1)).reshape(-1)
        position = (index + 1) % _P
        weights = (position, (position * position) % _P)  # < 2**62: no int64 overflow
        for k, (w, m) in enumerate(zip(weights, _MULTIPLIERS, strict=True)):
            sums[k] = (sums[k] + int(((lanes * ((w * m) % _P)) % _P).sum())) % _P
    return sums[0], sums[1]


def add_sums(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The sums of two disjoint parts of one tensor, combined."""
    return (a[0] + b[0]) % _P, (a[1] + b[1]) % _P


def format_sum(sums: tuple[int, int]) -> str:
    """The checksum as servers report it: 16 hex digits."""
    return f"{sums[0]:08x}{sums[1]:08x}"


# ---- low-rank adapters: only A and B travel, the receiver merges them into a kept copy of the base --------
#
# A ``model.lora`` run pushes each adapted projection's ``A [rank, in]`` and ``B [out, rank]`` under PEFT's
# saved names (what ``convert mcore-to-hf --adapter-only`` writes): ``base_model.model.<HF weight name without
# .weight>.lora_A.weight``. The bucket's request carries ``lora_scale`` (``alpha / rank``). The receiver keeps
# the weight it held before the first adapter arrived (the base the trainer's adapters sit on, frozen there)
# and installs ``W = W_base + lora_scale * B @ A``, computed in fp32 and cast to the weight's dtype, as the
# trainer's merged export computes it.
PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def adapter_target(name: str) -> tuple[str, str] | None:
    """(HF weight name, "A" or "B") of a PEFT adapter tensor name; None for any other name."""
    if not name.startswith(PEFT_PREFIX):
        return None
    for suffix, matrix in _LORA_SUFFIXES.items():
        if name.endswith(suffix):
            return name[len(PEFT_PREFIX):-len(suffix)] + ".weight", matrix
    return None


def adapter_name(hf_weight: str, matrix: str) -> str:
    """PEFT's saved name of adapter ``matrix`` ("A" or "B") of the HF weight ``hf_weight``."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{matrix}.weight"


def merge_update(weight: torch.Tensor, update: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``weight + update`` in ``weight``'s dtype, computed in fp32; into bf16 rounded stochastically."""
    total = weight.float() + update
    if weight.dtype != torch.bfloat16:
        return total.to(weight.dtype)
    out = torch.empty_like(weight)
    stochastic_round_(out, total, generator)
    return out


class AdapterMerge:
    """The receiving side's adapters: the kept base of every adapted weight and its latest ``A`` and ``B``.

    ``base_of(hf_name)`` returns the weight as served before any adapter (read once per weight). A whole weight
    pushed later replaces the weight outright: ``forget`` drops its kept base and adapter.

    A bf16 merge rounds stochastically (``util/rounding.py``): an adapter's update is mostly far below bf16's
    spacing, and rounded to nearest the served weights kept about 0.29 of the trained update along its own
    direction (SmolLM2, rank 8, after 12 steps); the trainer, which applies the adapters unmerged, saw all of
    it. Every receiver draws from the same seed, so servers with the same adapters serve the same weights.
    """

    def __init__(self, base_of: Callable[[str], torch.Tensor], seed: int = 0) -> None:
        self._base_of = base_of
        self._generator = torch.Generator().manual_seed(seed)
        self.base: dict[str, torch.Tensor] = {}
        self.pairs: dict[str, dict[str, torch.Tensor]] = {}
        self.scale: float | None = None

    def merged(self, tensors: dict[str, torch.Tensor], scale: float | None,
               shape_of: Callable[[str], Sequence[int] | None]) -> dict[str, torch.Tensor]:
        """``tensors`` with every adapter tensor replaced by the merged weight it changes (other names pass
        through). ``shape_of(hf_name)`` is the served weight's shape (None: no such weight). ``ValueError``
        names a bad adapter (unknown target, shapes that do not fit, no ``lora_scale``) before anything is
        kept."""
        plain = {n: t for n, t in tensors.items() if adapter_target(n) is None}
        updates: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            hit = adapter_target(name)
            if hit is not None:
                updates.setdefault(hit[0], {})[hit[1]] = t
        if not updates:
            return plain
        if scale is None or not math.isfinite(scale):
            raise ValueError(f"adapter tensors ({next(iter(updates))}) need a finite lora_scale, got {scale!r}")
        for target, pair in updates.items():
            self._check(target, {**self.pairs.get(target, {}), **pair}, shape_of(target))
        self.scale = scale
        for target, pair in updates.items():
            self.pairs.setdefault(target, {}).update({m: t.detach().float().clone() for m, t in pair.items()})
            if target not in self.base:
                self.base[target] = self._base_of(target).detach().clone()
            value = self.value(target)
            if value is not None:  # None: the other half comes in the next bucket
                plain[target] = value
        return plain

    def value(self, target: str) -> torch.Tensor | None:
        """The merged weight of ``target`` from its kept base and adapters; None until both halves came."""
        kept, base = self.pairs.get(target, {}), self.base.get(target)
        if base is None or "A" not in kept or "B" not in kept or self.scale is None:
            return None
        update = kept["B"].to(base.device) @ kept["A"].to(base.device)
        return merge_update(base, self.scale * update, self._generator)

    def forget(self, names: Iterable[str]) -> None:
        """Whole weights arrived for ``names``: their kept base and adapters no longer describe them."""
        for name in names:
            self.base.pop(name, None)
            self.pairs.pop(name, None)

    @staticmethod
    def _check(target: str, pair: dict[str, torch.Tensor], shape: Sequence[int] | None) -> None:
        if shape is None:
            raise ValueError(f"adapter for {target}: the model has no such weight")
        if not all(t.dim() == 2 and t.is_floating_point() for t in pair.values()):
            raise ValueError(f"adapter for {target}: A and B must be 2-d floating-point matrices")
        a, b = pair.get("A"), pair.get("B")
        out_f, in_f = shape
        if a is not None and a.shape[1] != in_f or b is not None and b.shape[0] != out_f or \
                a is not None and b is not None and a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter for {target}: A {list(a.shape) if a is not None else None} and B "
                             f"{list(b.shape) if b is not None else None} do not fit the weight's {list(shape)}")
