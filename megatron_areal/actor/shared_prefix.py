"""Sequences that begin alike are laid out once: a group's prompt is computed once, not per sample.

The samples of a GRPO group share their prompt token for token. Packed one after the other, each
sample recomputes the prompt in every layer: on the main job (prompts of about 50 tokens, answers
of about 30) that is more than half the trainer's tokens. A *unit* packs the shared tokens once and
then each member's remainder (its *branch*); the actor's attention lets every branch attend to the
shared tokens before its own (actor/attention.py), rotary positions continue from them
(megatron_areal/patches/packed_rope.py), and gradients of the shared tokens sum over the branches, as they would
over the repeated copies.

Only positions that no member trains on are shared: the shared tokens ``S[:s]`` give the values
of positions ``0 .. s-1`` (predicting tokens ``1 .. s``), so the members must agree on tokens
``0 .. s`` and have a zero loss mask on those positions. Each branch starts with token ``s``
again (it predicts the first branch token), so a branch costs one token more than its remainder.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

MIN_SHARED = 8  # fewer shared tokens than this are not worth laying out apart


@dataclass(frozen=True)
class Unit:
    """Sequences packed together; the first ``shared`` tokens of each are laid out once (0: none)."""

    members: tuple[int, ...]
    shared: int = 0

    def n_tokens(self, lengths: Sequence[int]) -> int:
        return self.shared + sum(lengths[i] - self.shared for i in self.members)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _untrained_prefix(mask: Sequence[float]) -> int:
    i = 0
    while i < len(mask) and not mask[i]:
        i += 1
    return i


def prefix_units(sequences: Sequence[Sequence[int]], ids: Sequence[int],
                 loss_masks: Sequence[Sequence[float]] | None = None, min_shared: int = MIN_SHARED) -> list[Unit]:
    """``ids`` grouped into units that save the most tokens: sequences that agree on at least
    ``min_shared + 1`` leading tokens (and, given ``loss_masks``, train on none of the shared
    positions) share them; the rest are units of one. Units come in the order of their first member
    in ``ids``; a unit's members keep their order in ids.

    Sorted, sequences with a common prefix are neighbours, and a run of neighbours can share the
    smallest prefix any two neighbours in it share. Samples of different prompts that begin with
    the same chat header share only the header, samples of one prompt the whole prompt: a run is
    cut at its weakest links when its parts save more on their own (``_best_runs``).
    """
    ordered = sorted(ids, key=lambda i: tuple(sequences[i]))
    if not ordered:
        return []

    def limit(i: int) -> int:  # a branch needs at least one token of its own: s <= L - 1
        own = len(sequences[i]) - 1
        return own if loss_masks is None else min(own, _untrained_prefix(loss_masks[i]))

    limits = [limit(i) for i in ordered]
    links = [min(_common_prefix(sequences[a], sequences[b]) - 1, limits[k], limits[k + 1])
             for k, (a, b) in enumerate(zip(ordered, ordered[1:]))]
    rank = {i: k for k, i in enumerate(ids)}
    units = []
    for lo, hi, shared in _best_runs(links, min_shared):
        members = tuple(sorted(ordered[lo:hi], key=rank.__getitem__))
        units.append(Unit(members, shared if len(members) > 1 else 0))
    return sorted(units, key=lambda u: rank[u.members[0]])


def _best_runs(links: Sequence[int], min_shared: int) -> list[tuple[int, int, int]]:
    """Runs ``(lo, hi, shared)`` of sorted members that save the most tokens, where ``links[k]`` is
    what members k and k + 1 can share. A run shares its weakest link, saving it once per member
    after the first; it is kept whole or cut at its weakest links into parts that are each at their
    best, whichever saves more. Computed bottom-up, strongest links first, by joining neighbouring
    segments, so the depth of nested prompts costs no recursion."""
    n = len(links) + 1
    end = list(range(1, n + 1))  # end[lo]: the segment starting at member lo ends before end[lo]
    start = list(range(-1, n))  # start[hi]: the segment ending before member hi starts at start[hi]
    best: dict[int, tuple[int, list[tuple[int, int, int]]]] = {k: (0, [(k, k + 1, 0)]) for k in range(n)}
    order = sorted(range(n - 1), key=lambda k: -links[k])
    for value, same in groupby(order, key=lambda k: links[k]):
        parts: dict[int, tuple[int, list]] = {}  # segments joined at this value: their parts' best
        for k in same:  # join the segment ending at member k with the one starting at k + 1
            a, b = start[k + 1], k + 1
            saved_a, runs_a = parts.pop(a, None) or best.pop(a)
            saved_b, runs_b = parts.pop(b, None) or best.pop(b)
            end[a] = end[b]
            start[end[b]] = a
            parts[a] = (saved_a + saved_b, runs_a + runs_b)
        for lo, (saved, runs) in parts.items():
            whole = (end[lo] - lo - 1) * value if value >= min_shared else 0
            best[lo] = (whole, [(lo, end[lo], value)]) if whole > 0 and whole >= saved else (saved, runs)
    return [run for _, runs in best.values() for run in runs]


def fit_to_budget(units: Sequence[Unit], lengths: Sequence[int], budget: int) -> list[Unit]:
    """Units of at most ``budget`` tokens: a larger unit is cut into consecutive runs of members
    (each a unit sharing the same prefix; a run of one shares nothing)."""
    out: list[Unit] = []
    for u in units:
        if u.n_tokens(lengths) <= budget or len(u.members) == 1:
            out.append(u)
            continue
        run: list[int] = []
        for i in u.members:
            if run and Unit(tuple(run + [i]), u.shared).n_tokens(lengths) > budget:
                out.append(Unit(tuple(run), u.shared if len(run) > 1 else 0))
                run = []
            run.append(i)
        out.append(Unit(tuple(run), u.shared if len(run) > 1 else 0))
    return out
