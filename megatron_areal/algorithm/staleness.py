"""The staleness gate's admission rule (docs/design.md, "Staleness gate"). Pure arithmetic."""
from __future__ import annotations


def staleness_capacity(eta: int, version: int, batch_size: int, accepted: int, running: int,
                       max_concurrent: int) -> int:
    """How many more rollouts may start now so that none is trained more than ``eta`` versions
    after its start: ``min(max_concurrent - running, (eta + version + 1) * batch_size -
    (accepted + running))``, never negative.

    ``accepted`` counts rollouts finished since the run began (trained or waiting in the
    buffer); ``running`` those in flight. With ``eta = 0`` at most one batch beyond the trained
    ones exists at any time: synchronous, on-policy behaviour from the same code.
    """
    for name, value in (("eta", eta), ("version", version), ("accepted", accepted), ("running", running)):
        if value < 0:
            raise ValueError(f"staleness_capacity: {name} must be >= 0, got {value}")
    if batch_size < 1 or max_concurrent < 1:
        raise ValueError("staleness_capacity: batch_size and max_concurrent must be >= 1")
    by_concurrency = max_concurrent - running
    by_staleness = (eta + version + 1) * batch_size - (accepted + running)
    return max(0, min(by_concurrency, by_staleness))
