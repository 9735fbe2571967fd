"""The project's vLLM plugin: a gloo weight-transfer engine for vLLM's CPU build.

vLLM's built-in weight-transfer engines are CUDA-only (NCCL, CUDA IPC). vLLM runs the functions of
the ``vllm.general_plugins`` entry-point group (``setup.py``) in each of its processes; ``register``
adds ``gloo_engine.GlooWeightTransferEngine`` to vLLM's engine registry under ``ENGINE_NAME``, so a
server started with ``--weight-transfer-config '{"backend": "gloo"}'`` takes weights through vLLM's
own ``/init_weight_transfer_engine`` and ``/update_weights`` calls on CPU.

Importing this package does not import vLLM: the trainer's environment need not have it.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ENGINE_NAME = "gloo"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register the gloo engine (lazily imported by vLLM)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, "megatron_areal.vllm_plugin.gloo_engine",
                                                    "GlooWeightTransferEngine")
    except ValueError:  # registered already: vLLM may load plugins more than once in one process
        log.debug("weight-transfer engine %r is registered already", ENGINE_NAME)
