"""Generated tasks split into a fixed held-out set and a training stream that never meets it.

A generated task (``arithmetic.py``, ``calculator.py``) gives a ``draw(rng)`` of one problem. Its
held-out pool is the first ``pool_size`` distinct problems drawn from a constant seed; a held-out
set of ``size`` is the pool's first ``size`` problems (the same whatever the run's seed), and the
training stream draws from the run's seed, skipping every problem of the pool.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import TypeVar

from megatron_areal.data.prompt import DataError

P = TypeVar("P", bound=Hashable)


def held_out_pool(draw: Callable[[random.Random], P], seed: int, pool_size: int) -> tuple[P, ...]:
    """The first ``pool_size`` distinct problems ``draw`` gives from ``seed``."""
    rng = random.Random(seed)
    seen: dict[P, None] = {}
    while len(seen) < pool_size:
        seen.setdefault(draw(rng))
    return tuple(seen)


def held_out(pool: tuple[P, ...], size: int, task: str) -> list[P]:
    """The held-out set of ``size`` problems: the pool's first ones."""
    if not 0 < size <= len(pool):
        raise DataError(f"{task}: size must be in 1..{len(pool)}, got {size}")
    return list(pool[:size])


def training(draw: Callable[[random.Random], P], pool: tuple[P, ...], seed: int, size: int, task: str) -> list[P]:
    """``size`` problems drawn with replacement from ``seed``, none of them in the held-out pool."""
    if size <= 0:
        raise DataError(f"{task}: size must be positive, got {size}")
    reserved = set(pool)
    rng = random.Random(seed)
    problems: list[P] = []
    while len(problems) < size:
        problem = draw(rng)
        if problem not in reserved:
            problems.append(problem)
    return problems
