"""Telling a request the servers refuse once from a run whose every request they refuse.

A group whose request a server rejects (HTTP 4xx: a prompt too long for the context, a sampling
parameter it does not support) is skipped and the run goes on: one bad prompt must not stop it.
When every group since the last success has been refused for the same reason, though, no group
will ever train, and skipping until ``get_batch`` times out wastes the allocation (13,461 groups in
150 s before it was caught). ``RefusalWatch`` says when a run has reached that state.
"""
from __future__ import annotations

import re

# Refusals of one cause differ only in numbers (request ids, ports, prompt lengths).
_NUMBER = re.compile(r"\d+")


def refusal_reason(error: BaseException) -> str:
    """What a server said when it refused (the rollout client's error), else the error itself."""
    cause = error.__cause__ or error
    return str(cause)


class RefusalWatch:
    """Counts consecutive refused groups of one reason; ``refused`` returns that reason once ``limit`` of
    them followed each other with no group succeeding in between."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._key: str | None = None
        self._count = 0

    def succeeded(self) -> None:
        """A group came back: the run can make progress."""
        self._key, self._count = None, 0

    def refused(self, error: BaseException) -> str | None:
        """Record a refused group; the refusal's reason when every one of the last ``limit`` groups was refused
        for it, else None."""
        reason = refusal_reason(error)
        key = _NUMBER.sub("#", reason)
        if key != self._key:
            self._key, self._count = key, 0
        self._count += 1
        return reason if self._count >= self.limit else None
