"""Busy intervals of every GPU group, for the utilisation figures, the no-double-booking check
and the timeline plot. Adjacent intervals of the same kind are merged to keep the record small."""
from __future__ import annotations

from collections import defaultdict


class Timeline:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.intervals: dict[str, list[list]] = defaultdict(list)  # resource -> [start, end, kind]
        self.busy: dict[str, float] = defaultdict(float)  # resource -> busy seconds (always kept)

    def add(self, resource: str, start: float, end: float, kind: str) -> None:
        if end <= start:
            return
        self.busy[resource] += end - start
        if not self.enabled:
            return
        spans = self.intervals[resource]
        if spans and spans[-1][2] == kind and abs(spans[-1][1] - start) < 1e-9:
            spans[-1][1] = end
        else:
            spans.append([start, end, kind])

    def overlaps(self, resources: list[str], kinds: set[str] | None = None) -> list[tuple[str, str, float]]:
        """Pairs of intervals (over ``resources`` together, of ``kinds`` if given) that overlap in
        time: the GPUs they name are booked twice. Empty when the schedule is sound."""
        spans = sorted((s, e, r) for r in resources for s, e, k in self.intervals.get(r, [])
                       if kinds is None or k in kinds)
        found = []
        end, owner = float("-inf"), ""
        for s, e, r in spans:
            if s < end - 1e-9:
                found.append((owner, r, s))
            if e > end:
                end, owner = e, r
        return found
