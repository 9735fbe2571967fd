"""A bench's ``RESULT name value`` lines, held back until every check of the bench has passed.

A bench measures, checks that what it measured is right (logprobs against a reference, a bitwise round
trip), and only then reports: ``emit()`` prints every RESULT line when no check failed, and otherwise
prints the failed checks to stderr, no RESULT at all, and returns a non-zero exit status. So a figure
copied from a bench's output (``scripts/record_bench.py``) is always one whose checks passed.
"""
from __future__ import annotations

import sys
from typing import TextIO


class Results:
    """Collects RESULT values and check outcomes; ``emit`` reports them once, at the end."""

    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.values: list[tuple[str, str]] = []
        self.failures: list[str] = []

    def add(self, name: str, value: float, digits: int = 3) -> None:
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"{self.bench}: RESULT name {name!r} must be one word")
        self.values.append((name, f"{value:.{digits}f}"))

    def check(self, ok: bool, failure: str) -> bool:
        """Record a check; ``failure`` says what went wrong when ``ok`` is false. Returns ``ok``."""
        if not ok:
            self.failures.append(failure)
        return ok

    @property
    def passed(self) -> bool:
        return not self.failures

    def emit(self, out: TextIO | None = None, err: TextIO | None = None) -> int:
        """Print the RESULT lines (all checks passed: returns 0) or the failures (returns 1)."""
        out, err = out or sys.stdout, err or sys.stderr
        if self.failures:
            for failure in self.failures:
                print(f"FAIL: {failure}", file=err)
            print(f"{self.bench}: {len(self.failures)} check(s) failed; no RESULT", file=err)
            return 1
        if not self.values:
            print(f"{self.bench}: measured nothing; no RESULT", file=err)
            return 1
        for name, value in self.values:
            print(f"RESULT {name} {value}", file=out)
        return 0
