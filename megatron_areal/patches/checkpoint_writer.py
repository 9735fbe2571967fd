"""Change ``checkpoint-writes-in-place``: megatron-core's checkpoint writer writes CPU tensors that view a
larger storage from the tensors themselves instead of from clones. Applied by ``checkpoint/training.py``
around each save (``written_in_place``).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, CPU) as a tensor over the same memory whose storage is exactly its own bytes: what
    ``torch.save`` writes of it is then the tensor, not the larger storage it may be a view of."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return torch.from_numpy(flat.numpy()).view(tensor.dtype).view(tensor.shape)


@contextmanager
def written_in_place() -> Iterator[None]:
    """Megatron's checkpoint writer clones every CPU tensor that is a view into a larger storage before it
    forks its writer processes, since ``torch.save`` would write the whole storage: our weights are views of
    the DDP parameter buffer and Megatron's SwiGLU factories cut the input projection's weight, master and
    moments into halves, so a save copied most of the state it wrote (0.65 GiB for SmolLM2-135M). Handed
    ``exact_storage`` aliases instead, it writes the same bytes from the tensors themselves. A save is
    synchronous and its writers are forked, so nothing changes them while they are written."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    own = MCoreSavePlanner.__dict__.get("resolve_data")
    resolve = MCoreSavePlanner.resolve_data

    def resolve_in_place(self: Any, write_item: Any) -> Any:
        data = resolve(self, write_item)
        if isinstance(data, torch.Tensor) and data.device.type == "cpu" and data.is_contiguous():
            return exact_storage(data)
        return data

    MCoreSavePlanner.resolve_data = resolve_in_place
    try:
        yield
    finally:
        if own is None:
            del MCoreSavePlanner.resolve_data
        else:
            MCoreSavePlanner.resolve_data = own
