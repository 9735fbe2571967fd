"""One packed micro-batch: several token sequences laid end to end in a single row (THD).

Alignment: a sequence of length L at offset ``o`` predicts its token ``i + 1`` at packed position
``o + i`` for ``i < L - 1``; its last position predicts nothing (``target_mask`` False). So the
L - 1 per-position values of sequence ``k`` (logprobs, loss mask, advantages, ...) live at
``[o_k, o_k + L_k - 1)``, matching ``Trajectory`` (token t given tokens < t).

When the row length must be a multiple of something (sequence parallelism splits the row over
TP ranks), a padding segment is appended; it is its own attention segment and carries no target.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per sequence
    targets: torch.Tensor  # [T] long, next token (0 where target_mask is False)
    target_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32
    max_seqlen: int
    seq_ids: list[int]  # caller's indices of the packed sequences, in order
    offsets: list[int]
    lengths: list[int]
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # per-position [T] tensors
    routes: torch.Tensor | None = None  # MoE: rollout's experts per position [T, layers, top_k] (routing_replay.py)

    @property
    def n_real_tokens(self) -> int:
        return sum(self.lengths)

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
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def split(self, per_position: torch.Tensor) -> list[torch.Tensor]:
        """Cut a ``[T]`` per-position tensor into the L - 1 values of each sequence."""
        return [per_position[o:o + n - 1] for o, n in zip(self.offsets, self.lengths)]

    def to(self, device: torch.device) -> PackedMicroBatch:
        moved = {k: v.to(device) for k, v in self.values.items()}
        return PackedMicroBatch(self.tokens.to(device), self.position_ids.to(device), self.targets.to(device),
                                self.target_mask.to(device), self.cu_seqlens.to(device), self.max_seqlen,
                                self.seq_ids, self.offsets, self.lengths, moved, self.routes)


def pack(sequences: Sequence[Sequence[int]], seq_ids: Sequence[int], pad_to_multiple: int = 1,
         values: dict[str, Sequence[Sequence[float]]] | None = None) -> PackedMicroBatch:
    """Pack ``sequences[i] for i in seq_ids``; ``values[name][i]`` holds L_i - 1 floats each.

    An empty ``seq_ids`` gives a padding-only micro-batch (all targets masked), which keeps DP
    ranks in lock step when there are fewer sequences than micro-batches.
    """
    tokens: list[int] = []
    targets: list[int] = []
    mask: list[bool] = []
    offsets, lengths, seg = [], [], [0]
    for i in seq_ids:
        seq = list(sequences[i])
        if len(seq) < 2:
            raise ValueError(f"sequence {i} has {len(seq)} token(s); a logprob needs at least 2")
        offsets.append(len(tokens))
        lengths.append(len(seq))
        tokens += seq
        targets += seq[1:] + [0]
        mask += [True] * (len(seq) - 1) + [False]
        seg.append(len(tokens))
    pad = (-len(tokens)) % pad_to_multiple or (pad_to_multiple if not tokens else 0)
    if pad:
        tokens += [0] * pad
        targets += [0] * pad
        mask += [False] * pad
        seg.append(len(tokens))
    positions = [p for a, b in zip(seg[:-1], seg[1:]) for p in range(b - a)]
    packed = {}
    for name, per_seq in (values or {}).items():
        flat = torch.zeros(len(tokens), dtype=torch.float32)
        for i, o, n in zip(seq_ids, offsets, lengths):
            if len(per_seq[i]) != n - 1:
                raise ValueError(f"{name} of sequence {i}: {len(per_seq[i])} values for {n} tokens (want {n - 1})")
            flat[o:o + n - 1] = torch.as_tensor(per_seq[i], dtype=torch.float32)
        packed[name] = flat
    cu = torch.tensor(seg, dtype=torch.int32)
    return PackedMicroBatch(
        tokens=torch.tensor(tokens, dtype=torch.long).unsqueeze(0),
        position_ids=torch.tensor(positions, dtype=torch.long).unsqueeze(0),
        targets=torch.tensor(targets, dtype=torch.long), target_mask=torch.tensor(mask, dtype=torch.bool),
        cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()), seq_ids=list(seq_ids), offsets=offsets,
        lengths=lengths, values=packed)
