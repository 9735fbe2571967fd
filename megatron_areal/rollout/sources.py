"""What the rollout loop needs from the data and reward parts, as Protocols.

The controller depends on these shapes only, so the dataset and the reward pool can change
without touching it (and a controller test can feed any prompt stream).
"""
from __future__ import annotations

from typing import Any, Protocol


class PromptLike(Protocol):
    """A prompt as the rollout loop sees it: its dataset index, its task, and the answer its replies are scored
    against."""

    index: int  # position in the dataset; what a checkpoint re-queues
    task: str  # which verifier scores the replies

    def reward_answer(self) -> Any: ...  # what the verifier compares a reply against


class PromptSourceLike(Protocol):
    """A resumable prompt iterator (``StopIteration`` when exhausted, if ever); ``push_back``
    makes the given prompt indices come out again first, in that order."""

    def __next__(self) -> PromptLike: ...

    def push_back(self, indices: list[int]) -> None:
        """Make these prompt indices come out again first, in this order."""

    def state_dict(self) -> dict[str, Any]:
        """The position in the stream, for a checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``."""


class RewardLike(Protocol):
    """A scored reply: the reward, and whether the verifier ran."""

    reward: float
    status: str  # "ok" when the verifier ran; anything else is counted as a reward failure


class ScorerLike(Protocol):
    """The reward service as the rollout loop uses it."""

    async def score(self, task: str, response_text: str, answer: Any) -> RewardLike:
        """Score one reply of ``task`` against ``answer``."""


class EpisodesLike(Protocol):
    """Agent episodes (``megatron_areal/agent/runner.py``) as the rollout loop uses them: a group's episodes
    run through the loop's ``generate(prompt_ids, max_new_tokens, key) -> SampleOutput``."""

    async def run_group(self, gid: int, prompt: PromptLike, version: int, generate: Any,
                        group_size: int) -> list[Any]:
        """The group's trajectories (``Trajectory``), scored by the agents."""

    def metrics(self) -> dict[str, float]:
        """Episode figures since the last call."""

    async def close(self) -> None:
        """Stop serving the agents."""
