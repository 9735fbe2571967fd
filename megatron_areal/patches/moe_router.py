"""What megatron-core 0.16.1's MoE layer needs to run without Transformer Engine.

``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` on every router
forward and backward, but the module defines that name only inside its ``try: import
transformer_engine`` block; without TE (the CPU, or a GPU with the local spec) the router raises
``NameError: name 'te_general_gemm' is not defined``. Defining the missing name as ``None`` selects
the function's own ``torch.mm`` branch, which is what its code intends without TE. Applied by
``build_model`` for MoE models; a no-op where TE imported.
"""
from __future__ import annotations


def ensure_router_gemm_fallback() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` where TE did not; True when it had to."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
