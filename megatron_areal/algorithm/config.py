"""Settings of the decoupled-PPO objective and the advantage estimator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_areal.configbase import require


@dataclass(kw_only=True)
class PPOConfig:
    """The decoupled-PPO objective (clip range, behaviour-weight corrections), mini-batches, the advantage
    estimator and the KL penalty."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None: same as eps_clip
    # Corrections of the behaviour weight w = pi_prox / pi_behav; formulas in algorithm/offpolicy.py.
    behav_imp_weight_cap: float | None = 5.0  # C: the upper bound on w (null: none)
    behav_imp_weight_mode: Literal["mask", "truncate"] = "mask"  # mask: drop w > C (MIS); truncate: min(w, C) (TIS)
    behav_imp_weight_low: float | None = None  # mask mode: also drop w < it (icepop-style two-sided mask)
    seq_imp_weight_low: float | None = None  # drop sequences whose geometric-mean w is below it
    seq_imp_weight_high: float | None = None  # ... or above it
    n_minibatches: int = 1  # optimizer steps per training batch
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    normalize_batch_advantage: bool = False  # whiten advantages over the whole batch (all DP ranks)
    kl_coef: float = 0.0  # KL penalty to the reference (initial) policy; 0 disables it
    decoupled: bool = True  # False: naive PPO (proximal = behaviour), for ablations
    # MoE: route every token to the experts the rollout chose (Trajectory.routed_experts; needs
    # rollout.return_routed_experts) in the proximal and training forwards (R3, actor/routing_replay.py)
    routing_replay: bool = False

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(0 < self.eps_clip < 1, "eps_clip", "must be in (0, 1)")
        require(self.eps_clip_high is None or self.eps_clip_high > 0, "eps_clip_high", "must be > 0")
        require(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
                "behav_imp_weight_cap", "must be > 1 (or null to disable)")
        require(self.behav_imp_weight_mode in ("mask", "truncate"), "behav_imp_weight_mode",
                f"must be 'mask' or 'truncate', got {self.behav_imp_weight_mode!r}")
        require(self.behav_imp_weight_mode != "truncate" or self.behav_imp_weight_cap is not None,
                "behav_imp_weight_cap", "truncate mode (TIS) needs a cap to truncate at")
        require(self.behav_imp_weight_low is None or 0 < self.behav_imp_weight_low < 1, "behav_imp_weight_low",
                "must be in (0, 1) (or null to disable)")
        require(self.behav_imp_weight_low is None or self.behav_imp_weight_mode == "mask", "behav_imp_weight_low",
                "is a token-mask bound: needs behav_imp_weight_mode 'mask'")
        require(self.seq_imp_weight_low is None or 0 < self.seq_imp_weight_low < 1, "seq_imp_weight_low",
                "must be in (0, 1) (or null to disable)")
        require(self.seq_imp_weight_high is None or self.seq_imp_weight_high > 1, "seq_imp_weight_high",
                "must be > 1 (or null to disable)")
        require(self.n_minibatches >= 1, "n_minibatches", "must be >= 1")
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
