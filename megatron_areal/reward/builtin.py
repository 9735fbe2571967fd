"""The verifiers every run has: ``math``, ``arithmetic`` and ``code``."""
from __future__ import annotations

from megatron_areal.reward.arithmetic import verify_number
from megatron_areal.reward.code import CodeVerifier
from megatron_areal.reward.config import RewardConfig
from megatron_areal.reward.math_answer import MathVerifier
from megatron_areal.reward.registry import VerifierRegistry
from megatron_areal.reward.sandbox import SandboxLimits


def sandbox_limits(config: RewardConfig) -> SandboxLimits:
    return SandboxLimits(wall_s=config.code_wall_s, cpu_s=config.code_cpu_s, memory_mb=config.code_memory_mb,
                         max_processes=config.code_max_processes, file_mb=config.code_file_mb,
                         python=config.code_python)


def default_registry(config: RewardConfig | None = None) -> VerifierRegistry:
    """A fresh registry with the built-in verifiers; callers may register more on it."""
    config = config or RewardConfig()
    registry = VerifierRegistry()
    registry.register("math", MathVerifier(config.math_deadline_s))
    registry.register("arithmetic", verify_number)
    registry.register("code", CodeVerifier(sandbox_limits(config)))
    return registry
