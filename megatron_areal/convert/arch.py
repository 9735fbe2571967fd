"""Old import path of ``megatron_areal.model.arch``, kept while server modules still import it."""
from megatron_areal.model.arch import (  # noqa: F401
    SUPPORTED_MODEL_TYPES,
    ModelArch,
    UnsupportedModelError,
    arch_from_hf_config,
    load_arch,
)
