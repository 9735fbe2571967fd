"""Pure tensor math of the RL objective: no process groups, no I/O."""
from megatron_areal.algorithm.advantages import ADVANTAGE_KINDS, group_advantages, normalize_advantages
from megatron_areal.algorithm.ppo import PPOObjective, decoupled_ppo_loss, kl_penalty
from megatron_areal.algorithm.staleness import staleness_capacity

__all__ = ["ADVANTAGE_KINDS", "PPOObjective", "decoupled_ppo_loss", "group_advantages", "kl_penalty",
           "normalize_advantages", "staleness_capacity"]
