"""Old import path of ``megatron_areal.model.weights``, kept while server tests still import it."""
from megatron_areal.model.weights import load_hf_weights  # noqa: F401
