"""Change ``precision-aware-adam-without-te``: megatron-core's precision-aware distributed optimizer built
around our ``PrecisionAwareAdam`` (``actor/precision_adam.py``) where it would take Transformer Engine's
FusedAdam.

megatron-core 0.16.1's ``get_megatron_optimizer`` builds the precision-aware mode only with TE's FusedAdam
(``USING_PYTORCH_OPTIMIZER`` false and ``is_te_min_version("2.1.0.dev0")``), its Adam class named ``Adam``
in ``megatron.core.optimizer``. Applied by ``actor/optim.py`` while it builds the optimizer
(``optimizer.precision_aware: true``), and undone right after.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import megatron.core.optimizer as mcore_optimizer


@contextmanager
def inner_adam(adam: Any) -> Iterator[None]:
    """While inside, ``get_megatron_optimizer`` builds ``adam`` as TE's FusedAdam (keyword arguments included)."""
    names = ("Adam", "USING_PYTORCH_OPTIMIZER", "is_te_min_version")
    saved = [getattr(mcore_optimizer, n) for n in names]
    for name, value in zip(names, (adam, False, lambda *a, **k: True), strict=True):
        setattr(mcore_optimizer, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(mcore_optimizer, name, value)
