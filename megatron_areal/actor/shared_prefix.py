"""Sequences that begin alike are laid out once: a group's prompt is computed once, not per sample.

The samples of a GRPO group share their prompt token for token. Packed one after the other, each
sample recomputes the prompt in every layer: on the main job (prompts of about 50 tokens, answers
of about 30) that is more than half the trainer's tokens. A *unit* packs the shared tokens once and
then each member's remainder (its *branch*); the actor's attention lets every branch attend to the
shared tokens before its own (actor/attention.py), rotary positions continue from them
(actor/packed_rope.py), and gradients of the shared tokens sum over the branches, as they would
over the repeated copies.

Only positions that no member trains on are shared: the shared tokens ``S[:s]`` give the values
of positions ``0 .. s-1`` (predicting tokens ``1 .. s``), so the members must agree on tokens
``0 .. s`` and have a zero loss mask on those positions. Each branch starts with token ``s``
again (it predicts the first branch token), so a branch costs one token more than its remainder.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """``ids`` grouped into units: sequences that agree on at least ``min_shared + 1`` leading tokens
    (and, given ``loss_masks``, train on none of the shared positions) share them; the rest are
    units of one. Units come in the order of their first member in ``ids``; a unit's members keep
    their order in ``ids``."""
    ordered = sorted(ids, key=lambda i: tuple(sequences[i]))
    runs: list[tuple[list[int], int]] = []
    for i in ordered:
        # a branch needs at least one token of its own: s <= L - 1 for every member
        limit = len(sequences[i]) - 1
        if loss_masks is not None:
            limit = min(limit, _untrained_prefix(loss_masks[i]))
        if runs:
            members, shared = runs[-1]
            s = min(shared, _common_prefix(sequences[members[-1]], sequences[i]) - 1, limit)
            if s >= min_shared:
                runs[-1] = (members + [i], s)
                continue
        runs.append(([i], limit))
    rank = {i: k for k, i in enumerate(ids)}
    units = [Unit(tuple(sorted(m, key=rank.__getitem__)), s if len(m) > 1 else 0) for m, s in runs]
    return sorted(units, key=lambda u: rank[u.members[0]])


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
