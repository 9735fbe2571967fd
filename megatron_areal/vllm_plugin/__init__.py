"""The project's vLLM plugin: weight-transfer engines that join the trainer's weight-update group.

vLLM's built-in weight-transfer engines are CUDA-only (NCCL, CUDA IPC), and its ``nccl`` engine forms its
group with a rendezvous of its own, which the trainer's push (``weights/``, the same one SGLang and the
embedded server join) does not speak. vLLM runs the functions of the ``vllm.general_plugins`` entry-point
group (``setup.py``) in each of its processes; ``register`` adds ``group_engine``'s engines to vLLM's
engine registry under the names of ``ENGINES``, so a server started with ``--weight-transfer-config
'{"backend": NAME}'`` takes weights through vLLM's own ``/init_weight_transfer_engine`` and
``/update_weights`` calls: over gloo on CPU, over the trainer's NCCL group on GPUs.

Importing this package does not import vLLM: the trainer's environment need not have it.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CPU_ENGINE = "gloo"
GPU_ENGINE = "megatron-areal-nccl"
ENGINES = {CPU_ENGINE: "gloo", GPU_ENGINE: "nccl"}  # engine name -> backend of the trainer's group
_CLASSES = {"gloo": "GlooWeightTransferEngine", "nccl": "NcclWeightTransferEngine"}


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register the engines (lazily imported by vLLM)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, backend in ENGINES.items():
        try:
            WeightTransferEngineFactory.register_engine(name, "megatron_areal.vllm_plugin.group_engine",
                                                        _CLASSES[backend])
        except ValueError:  # registered already: vLLM may load plugins more than once in one process
            log.debug("weight-transfer engine %r is registered already", name)
