"""Settings of the decoupled-PPO objective and the advantage estimator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class PPOConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: same as eps_clip
    behav_imp_weight_cap: float | None = 5.0  # drop tokens whose w = pi_prox / pi_behav exceeds it
    n_minibatches: int = 1  # optimizer steps per training batch
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    normalize_batch_advantage: bool = False  # whiten advantages over the whole batch (all DP ranks)
    kl_coef: float = 0.0  # KL penalty to the reference (initial) policy; 0 disables it
    decoupled: bool = True  # False: naive PPO (proximal = behaviour), for ablations

    def validate(self) -> None:
        require(0 < self.eps_clip < 1, "eps_clip", "must be in (0, 1)")
        require(self.eps_clip_high is None or self.eps_clip_high > 0, "eps_clip_high", "must be > 0")
        require(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
                "behav_imp_weight_cap", "must be > 1 (or null to disable)")
        require(self.n_minibatches >= 1, "n_minibatches", "must be >= 1")
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
