"""One packed micro-batch: several token sequences laid end to end in a single row (THD).

Alignment: a sequence of length L at offset ``o`` predicts its token ``i + 1`` at packed position
``o + i`` for ``i < L - 1``; its last position predicts nothing (``target_mask`` False). So the
L - 1 per-position values of sequence ``k`` (logprobs, loss mask, advantages, ...) live at
``[o_k, o_k + L_k - 1)``, matching ``Trajectory`` (token t given tokens < t). Sequences sharing
their first tokens (actor/shared_prefix.py) lay them out once; ``value_index`` says where each
sequence's values are in either case.

When the row length must be a multiple of something (sequence parallelism splits the row over
TP ranks), a padding segment is appended; it is its own attention segment and carries no target.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_areal.actor.shared_prefix import Unit


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long: each sequence's own positions (a branch continues its shared tokens)
    targets: torch.Tensor  # [T] long, next token (0 where target_mask is False)
    target_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32
    max_seqlen: int  # longest sequence (positions run below it)
    seq_ids: list[int]  # caller's indices of the packed sequences, in order
    value_index: list[torch.Tensor]  # per packed sequence: the packed positions of its L - 1 values
    n_real_tokens: int  # tokens before the padding
    continues: tuple[int, ...] = ()  # per segment: the segment of shared tokens it follows, -1 if none
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # per-position [T] tensors
    routes: torch.Tensor | None = None  # MoE: rollout's experts per position [T, layers, top_k] (routing_replay.py)

    @property
    def n_tokens(self) -> int:
        return self.tokens.size(1)

    def padding_mask(self) -> torch.Tensor:
        """``[1, T]`` bool, True at the padding appended after the sequences (Megatron's MoE routers
        leave those tokens out of the load-balancing loss)."""
        mask = torch.zeros_like(self.tokens, dtype=torch.bool)
        mask[:, self.n_real_tokens:] = True
        return mask

    def packed_seq_params(self) -> PackedSeqParams:
        if any(c >= 0 for c in self.continues):
            # the rotary table reads the positions from here (megatron_areal/patches/packed_rope.py)
            self.cu_seqlens.positions = self.position_ids[0]
        return SharedPrefixParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                                  max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
                                  continues=self.continues)

    def split(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """The L - 1 values of each packed sequence out of a ``[T]`` per-position tensor."""
        return [per_position[idx.to(per_position.device)] for idx in self.value_index]

    def to(self, device: torch.device) -> PackedMicroBatch:
        moved = {k: v.to(device) for k, v in self.values.items()}
        return PackedMicroBatch(self.tokens.to(device), self.position_ids.to(device), self.targets.to(device),
                                self.target_mask.to(device), self.cu_seqlens.to(device), self.max_seqlen,
                                self.seq_ids, self.value_index, self.n_real_tokens, self.continues, moved,
                                self.routes)


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """Megatron's packed-sequence parameters plus, per segment, the segment of shared tokens it
    continues (-1: none); only the actor's ``PackedCoreAttention`` reads ``continues``."""

    continues: tuple[int, ...] = ()


def pack(sequences: Sequence[Sequence[int]], units: Sequence[Unit | int], pad_to_multiple: int = 1,
         values: dict[str, Sequence[Sequence[float]]] | None = None) -> PackedMicroBatch:
    """Pack the sequences of ``units`` (actor/shared_prefix.py; a plain index is a unit of one);
    ``values[name][i]`` holds L_i - 1 floats each. A unit sharing ``s`` tokens lays them out once as
    a segment of their own, then each member's tokens from ``s`` on as a segment continuing it; the
    values of the shared positions are the first member's (no member trains on them).

    An empty ``units`` gives a padding-only micro-batch (all targets masked), which keeps DP ranks
    in lock step when there are fewer sequences than micro-batches.
    """
    units = [u if isinstance(u, Unit) else Unit((u,)) for u in units]
    tokens: list[int] = []
    targets: list[int] = []
    mask: list[bool] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    index: list[list[int]] = []
    seg, continues = [0], []

    def segment(part: list[int], first_position: int, continuing: int) -> int:
        """Append ``part`` as a segment (its last position predicts nothing); its start."""
        start = len(tokens)
        tokens.extend(part)
        targets.extend(part[1:] + [0])
        mask.extend([True] * (len(part) - 1) + [False])
        positions.extend(range(first_position, first_position + len(part)))
        seg.append(len(tokens))
        continues.append(continuing)
        return start

    for u in units:
        for i in u.members:
            if len(sequences[i]) < 2:
                raise ValueError(f"sequence {i} has {len(sequences[i])} token(s); a logprob needs at least 2")
        s = u.shared
        shared_start, shared_segment = -1, -1
        if s:
            first = list(sequences[u.members[0]])
            shared_start, shared_segment = segment(first[:s], 0, -1), len(continues) - 1
            targets[-1], mask[-1] = first[s], True  # the last shared position predicts every branch's first token
        for i in u.members:
            seq = list(sequences[i])
            start = segment(seq[s:], s, shared_segment)
            seq_ids.append(i)
            index.append(list(range(shared_start, shared_start + s)) + list(range(start, start + len(seq) - s - 1)))
    n_real = len(tokens)
    pad = (-len(tokens)) % pad_to_multiple or (pad_to_multiple if not tokens else 0)
    if pad:
        segment([0] * pad, 0, -1)
        mask[n_real:] = [False] * pad
    packed = {}
    for name, per_seq in (values or {}).items():
        flat = torch.zeros(len(tokens), dtype=torch.float32)
        for i, idx in reversed(list(zip(seq_ids, index))):  # shared positions end with the first member's
            if len(per_seq[i]) != len(sequences[i]) - 1:
                raise ValueError(f"{name} of sequence {i}: {len(per_seq[i])} values for {len(sequences[i])} "
                                 f"tokens (want {len(sequences[i]) - 1})")
            flat[idx] = torch.as_tensor(per_seq[i], dtype=torch.float32)
        packed[name] = flat
    cu = torch.tensor(seg, dtype=torch.int32)
    return PackedMicroBatch(
        tokens=torch.tensor(tokens, dtype=torch.long).unsqueeze(0),
        position_ids=torch.tensor(positions, dtype=torch.long).unsqueeze(0),
        targets=torch.tensor(targets, dtype=torch.long), target_mask=torch.tensor(mask, dtype=torch.bool),
        cu_seqlens=cu, max_seqlen=max(max(positions) + 1, int((cu[1:] - cu[:-1]).max())), seq_ids=seq_ids,
        value_index=[torch.tensor(idx, dtype=torch.long) for idx in index], n_real_tokens=n_real,
        continues=tuple(continues), values=packed)
