"""Padding-free packing of variable-length sequences into micro-batches under a token budget.

Pure Python. ``allocate_microbatches`` answers: which sequence goes into which micro-batch of which
data-parallel rank, so that

- no micro-batch holds more than ``budget`` tokens;
- every DP rank runs the same number of micro-batches (a pipeline schedule and the gradient
  all-reduce need them in lock step), at least ``min_microbatches`` (2 x PP keeps a 1F1B pipeline
  full);
- the token loads of micro-batches, and of DP ranks, are balanced.

The count comes from first-fit-decreasing (FFD, close to the fewest bins that fit), rounded up to
a multiple of the DP size; the sequences are then spread over that many bins either greedily,
largest first into the least-loaded bin (``"ffd"``), or by Karmarkar-Karp largest differencing
(``"kk"``), which balances better. If a spread breaks the budget, one more micro-batch per DP
rank is tried. A micro-batch can be empty only when there are fewer sequences than micro-batches.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Literal

Method = Literal["ffd", "kk"]


class PackingError(ValueError):
    """A sequence cannot be placed (too long) or the arguments are inconsistent."""


def ffd_pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing: indices of ``lengths`` per bin, no bin over ``budget``."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def lpt_spread(lengths: Sequence[int], k: int, budget: int | None = None) -> list[list[int]] | None:
    """Largest first into the least-loaded of ``k`` bins that still fits; None if one cannot fit."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        popped = []
        while heap:
            load, b = heapq.heappop(heap)
            if budget is None or load + lengths[i] <= budget:
                bins[b].append(i)
                heapq.heappush(heap, (load + lengths[i], b))
                break
            popped.append((load, b))
        else:
            return None
        for item in popped:
            heapq.heappush(heap, item)
    return bins


def kk_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp k-way largest differencing: ``k`` parts with near-equal sums."""
    if k < 1:
        raise PackingError(f"kk_partition: k must be >= 1, got {k}")
    # Each heap entry is a partial solution of k (sum, indices) parts sorted by sum, descending,
    # keyed by its spread; merging the two widest pairs the heavy parts of one with the light of
    # the other.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for n, i in enumerate(range(len(lengths))):
        parts = [(lengths[i], [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-lengths[i], n, parts))
    counter = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))),
                        key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(ix) for _, ix in heap[0][2]]


def _assign_to_ranks(bins: list[list[int]], lengths: Sequence[int], dp: int) -> list[list[list[int]]]:
    """Give each DP rank len(bins)/dp bins, heaviest bins first to the lightest rank."""
    per_rank = len(bins) // dp
    load = [0] * dp
    out: list[list[list[int]]] = [[] for _ in range(dp)]
    for b in sorted(bins, key=lambda b: -sum(lengths[i] for i in b)):
        rank = min((r for r in range(dp) if len(out[r]) < per_rank), key=lambda r: load[r])
        out[rank].append(b)
        load[rank] += sum(lengths[i] for i in b)
    return out


def check_lengths(lengths: Sequence[int], budget: int, max_len: int | None = None) -> None:
    if budget < 1:
        raise PackingError(f"token budget must be >= 1, got {budget}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise PackingError(f"sequence {i} is empty (length {n})")
        if max_len is not None and n > max_len:
            raise PackingError(f"sequence {i} has {n} tokens, more than model.max_seq_len={max_len}")
        if n > budget:
            raise PackingError(f"sequence {i} has {n} tokens, more than the micro-batch token budget "
                               f"parallel.max_tokens_per_mb={budget}")


def allocate_microbatches(lengths: Sequence[int], budget: int, dp: int = 1, min_microbatches: int = 1,
                          method: Method = "ffd", max_len: int | None = None) -> list[list[list[int]]]:
    """Sequence indices per micro-batch per DP rank: ``result[rank][mb] -> [index, ...]``.

    Every rank gets the same number of micro-batches (>= ``min_microbatches``); each micro-batch
    holds at most ``budget`` tokens; each sequence appears exactly once.
    """
    if dp < 1 or min_microbatches < 1:
        raise PackingError(f"dp ({dp}) and min_microbatches ({min_microbatches}) must be >= 1")
    if method not in ("ffd", "kk"):
        raise PackingError(f"packing method {method!r} is not one of 'ffd', 'kk'")
    check_lengths(lengths, budget, max_len)
    per_rank = max(math.ceil(len(ffd_pack(lengths, budget)) / dp), min_microbatches)
    while True:
        k = per_rank * dp
        bins = kk_partition(lengths, k) if method == "kk" else lpt_spread(lengths, k, budget)
        if bins is not None and all(sum(lengths[i] for i in b) <= budget for b in bins):
            return _assign_to_ranks(bins, lengths, dp)
        per_rank += 1  # a balanced spread broke the budget: one more micro-batch per rank


def utilisation(lengths: Sequence[int], bins: list[list[int]], budget: int) -> float:
    """Fraction of the ``len(bins) * budget`` token slots that hold real tokens."""
    return sum(lengths[i] for b in bins for i in b) / max(len(bins) * budget, 1)
