"""Settings of rollout generation and the staleness gate."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_areal.configbase import require

# Beyond it sampling is close to uniform over the vocabulary: no policy left to improve.
MAX_TEMPERATURE = 2.0
# Below it (but above 0, greedy) the policy's logprobs stop being computable or comparable: dividing logits
# by 1e-40 overflows fp32 and the trainer's log-softmax is NaN, and vLLM raises any temperature in (0, 0.01)
# to 0.01 (``_MAX_TEMP`` in vllm/sampling_params.py, "may cause numerical errors nan or inf"), so its
# tokens would be drawn at another temperature than the trainer scores them at.
MIN_TEMPERATURE = 0.01


@dataclass(kw_only=True)
class RolloutConfig:
    """What is generated per step (groups, samples per prompt, sampling), how much may be in flight, and the
    servers' timeouts."""

    batch_size: int = 8  # prompts (groups) per training step
    group_size: int = 8  # samples per prompt
    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_concurrent: int = 64  # in-flight groups across all servers
    filter_equal_rewards: bool = True  # drop groups whose rewards are all equal (no signal)
    request_timeout_s: float = 3600.0  # one /generate segment; past it the server is marked down
    health_interval_s: float = 5.0  # how often servers marked down are probed for recovery
    # MoE models: ask the servers for the experts each token was routed to and keep them on the
    # trajectory (``Trajectory.routed_experts``), for routing replay in the trainer. SGLang servers
    # must run with --enable-return-routed-experts.
    return_routed_experts: bool = False
    # Agent episodes (docs/agents.md): ``package.module:run_episode`` turns every sample into an episode of
    # completions its agent asks for through an OpenAI-compatible endpoint; "" means one completion per sample.
    workflow: str = ""
    max_turns: int = 8  # completions per episode
    max_episode_tokens: int = 1024  # one episode sequence (prompt, replies, tool results); <= model.max_seq_len
    episode_timeout_s: float = 600.0  # past it the episode ends with reward 0

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        require(self.group_size >= 1, "group_size", "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                f"must be in [0, {MAX_TEMPERATURE}] (0: greedy)")
        require(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE, "temperature",
                f"{self.temperature:g} is below {MIN_TEMPERATURE}, where the trainer's logprobs overflow or differ "
                "from the server's (use 0 for greedy)")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        require(self.max_concurrent >= 1, "max_concurrent", "must be >= 1")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        require(self.health_interval_s > 0, "health_interval_s", "must be > 0")
        require(not self.workflow or ":" in self.workflow, "workflow", "must be 'package.module:function'")
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        require(self.max_episode_tokens >= 2, "max_episode_tokens", "must be >= 2")
        require(self.episode_timeout_s > 0, "episode_timeout_s", "must be > 0")


@dataclass(kw_only=True)
class StalenessConfig:
    """The staleness bound ``eta`` and whether generation overlaps training (``overlap = false`` with ``eta =
    0``: synchronous)."""

    eta: int = 4  # max policy versions between a rollout's start and its training step
    overlap: bool = True  # False with eta 0: synchronous (generate the batch, then train)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.eta >= 0, "eta", "must be >= 0")
        require(self.overlap or self.eta == 0, "overlap", "false (synchronous mode) requires staleness.eta = 0")
