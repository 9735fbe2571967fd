"""The records a run passes between its parts: one generated sample (``Trajectory``), as it travels from the
servers through the reward to the trainer, and the scored samples of one prompt (``Group``).

Shared by the rollout side that produces them and the actor, the PPO batch, the ledger and the agent code
that consume them; this module imports nothing of the package.

Token alignment: ``input_ids = prompt_ids + output_ids``. Per-token quantities of the output
(``output_logprobs``, ``output_versions``) have one entry per output token; the trainer's
per-position logprobs of a sequence of length L have L - 1 entries (token t given tokens < t),
so the output token k sits at position ``len(prompt_ids) - 1 + k`` of that vector.

``routed_experts`` (MoE models, with ``rollout.return_routed_experts``) follows the same L - 1
positions: the experts the rollout routed each of tokens 0 .. L - 2 to, in every layer, as int32
bytes of shape ``(L - 1, num_layers, top_k)`` in C order (SGLang's ``return_routed_experts``
array); ``torch.frombuffer(bytearray(t.routed_experts), dtype=torch.int32).view(L - 1, layers,
top_k)`` reads it. A sample interrupted by weight updates has, at each position, the routing of
the weights that produced the token after it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Trajectory:
    """One sample: its prompt and output tokens, the behaviour logprob and weight version of each output token,
    the version it started at, its group and prompt, and its reward.

    A multi-turn episode (``megatron_areal/agent``) is one trajectory whose output holds every turn after
    the first prompt: the policy's replies and, between them, the tokens the environment added (tool
    results, the next user message, the chat template's headers). ``output_mask`` marks which output
    tokens the policy generated (1, trained) and which came from the environment (0: their logprob is 0
    and their version that of the reply before them). Empty means every output token is the policy's.

    An episode whose turns do not extend each other becomes several trajectories with the episode's reward;
    ``episode`` (the same id, unique within the group) ties them together, so that what counts the samples
    of a group (group advantages, the all-equal-rewards filter, the mean reward) counts the episode once
    (``episodes``). -1, the default, makes the trajectory an episode of its own: every single-completion
    sample, and trajectories saved before the field existed."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # behaviour policy, per output token
    output_versions: list[int] = field(default_factory=list)  # weight version that produced each token
    start_version: int = 0  # policy version when generation started (the staleness gate's version)
    group_id: int = 0  # samples of one prompt share it
    prompt_index: int = 0  # position of the prompt in the dataset stream
    answer: Any = None  # what the reward compares against (gold answer, unit tests)
    task: str = "math"  # which verifier scores it
    reward: float = 0.0
    finish_reason: str = ""  # stop | length | abort
    interruptions: int = 0  # times generation was paused and resumed under newer weights
    routed_experts: bytes | None = None  # see the module docstring
    output_mask: list[int] = field(default_factory=list)  # per output token: 1 policy, 0 environment
    episode: int = -1  # agent episodes: the episode's id within its group; -1: an episode of its own

    @property
    def policy_mask(self) -> list[int]:
        """Per output token: 1 where the policy generated it (``output_mask``, or all when it is empty)."""
        return list(self.output_mask) if self.output_mask else [1] * len(self.output_ids)

    @property
    def input_ids(self) -> list[int]:
        """Prompt and output tokens, as the actor computes on them."""
        return self.prompt_ids + self.output_ids

    @property
    def loss_mask(self) -> list[int]:
        """Per-position mask over the L - 1 next-token predictions: 1 on the policy's output tokens."""
        return [0] * (len(self.prompt_ids) - 1) + self.policy_mask

    @property
    def behavior_logprobs(self) -> list[float]:
        """Per-position behaviour logprobs (0 on prompt positions), aligned with ``loss_mask``."""
        return [0.0] * (len(self.prompt_ids) - 1) + list(self.output_logprobs)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (checkpoints, the broadcast from rank 0)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """The trajectory ``to_dict`` wrote."""
        return cls(**data)


def episodes(trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """The indices of ``trajectories`` grouped by episode, in order of first appearance: those of one group
    with the same ``episode`` id (>= 0) form one episode, one with ``episode < 0`` is an episode alone."""
    out: list[list[int]] = []
    shared: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(trajectories):
        if t.episode < 0:
            out.append([i])
            continue
        key = (t.group_id, t.episode)
        if key not in shared:
            shared[key] = []
            out.append(shared[key])
        shared[key].append(i)
    return out


@dataclass
class Group:
    """The ``group_size`` samples of one prompt, scored."""
    group_id: int
    prompt_index: int
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def start_version(self) -> int:
        """The oldest policy version any of the group's samples started at: the group's age."""
        return min(t.start_version for t in self.trajectories)

    @property
    def episode_rewards(self) -> list[float]:
        """One reward per episode (``episodes``), in order: what the group's advantages see."""
        return [self.trajectories[ix[0]].reward for ix in episodes(self.trajectories)]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {"group_id": self.group_id, "prompt_index": self.prompt_index,
                "trajectories": [t.to_dict() for t in self.trajectories]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Group:
        """The group ``to_dict`` wrote."""
        return cls(group_id=data["group_id"], prompt_index=data["prompt_index"],
                   trajectories=[Trajectory.from_dict(t) for t in data["trajectories"]])
