"""Reward service: math verification, sandboxed code execution, the process pool with timeouts.

Names are imported lazily: the configuration tree imports ``reward.config`` and must not pay
for math-verify (sympy) on every command.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RewardConfig": "megatron_areal.reward.config",
    "RewardResult": "megatron_areal.reward.worker",
    "RewardService": "megatron_areal.reward.service",
    "SandboxUnavailable": "megatron_areal.reward.sandbox",
    "UnknownTask": "megatron_areal.reward.registry",
    "Verdict": "megatron_areal.reward.registry",
    "VerifierRegistry": "megatron_areal.reward.registry",
    "default_registry": "megatron_areal.reward.builtin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_areal.reward' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
