"""Change ``optimizer-state-views``: at data-parallel size 1, the distributed optimizer describes its state for
a checkpoint as views of its own tensors instead of gathered copies.

megatron-core 0.16.1's ``DistributedOptimizer.sharded_param_state_fully_reshardable`` gathers every rank's
fp32 master weights and Adam moments into new whole-model tensors to save them, and allocates the same
tensors to load into; at DP size 1 the rank already holds each parameter's whole state. Applied by
``checkpoint/training.py`` around each save and load (``state_as_views``), on that optimizer instance only.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any


def param_state_as_views(opt: Any, model_sharded_state_dict: Any, is_loading: bool = False,
                          metadata: dict | None = None) -> dict[int, dict[str, Any]]:
    """Megatron's ``fully_reshardable`` parameter state of a distributed optimizer at DP size 1, without copies.

    To save that format Megatron gathers every rank's fp32 master weights and Adam moments into new
    whole-model tensors (three copies, then the pieces, then their concatenation: about 4 GiB transient
    for a 135M model); to load it, it allocates the same fp32 whole-model tensors to read into (about 1.5
    GiB) and then copies them into the optimizer. At DP size 1 the rank holds each parameter's whole
    state already, so the same sharded tensors (keys, shapes, replica ids) are views of the optimizer's
    own tensors: a save reads from them and a load writes into them.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sh.data: sh for sh in nested_values(sharded)}
    out: dict[int, dict[str, Any]] = {}
    for buffer in opt.buffers:
        for model_param in buffer.param_index_map:
            meta = by_param[model_param]
            tensors = {}
            for key, value in opt._get_main_param_and_optimizer_states(model_param).items():
                if key == "step":
                    continue  # travels in the param groups
                view = value.detach().view(meta.data.shape)
                kwargs = dict(key=f"optimizer.state.{key}.{meta.key}", data=view, dtype=view.dtype,
                              replica_id=meta.replica_id)
                if isinstance(meta, ShardedTensorFactory):
                    kwargs.pop("dtype")
                tensors[key] = replace(meta, **kwargs)
                tensors[key].validate_metadata_integrity()
            out[len(out)] = tensors
    return out


@contextmanager
def state_as_views(optimizer: Any) -> Iterator[None]:
    """Distributed optimizers at DP size 1 describe their state with ``param_state_as_views`` meanwhile."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = [sub for sub in getattr(optimizer, "chained_optimizers", [optimizer])
               if isinstance(sub, DistributedOptimizer) and sub.data_parallel_group.size() == 1]
    for sub in patched:
        sub.sharded_param_state_fully_reshardable = functools.partial(param_state_as_views, sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.sharded_param_state_fully_reshardable
