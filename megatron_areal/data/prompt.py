"""The prompt record every dataset yields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DataError(ValueError):
    """A dataset problem; the message names the file and line, or the task."""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    index: int  # position in its dataset; what the prompt stream and checkpoints refer to
    text: str | None = None  # a plain user message ...
    messages: tuple[dict[str, str], ...] | None = None  # ... or a whole conversation
    answer: Any = None  # gold answer (math, arithmetic); for code the reference solution if known
    task: str = "math"  # the verifier that scores replies
    tests: str | None = None  # code tasks: Python source that raises when the reply is wrong
    entry_point: str | None = None  # code tasks: HumanEval-style ``check(entry_point)``
    code_prefix: str | None = None  # code tasks: the given signature a bare completion continues

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise DataError(f"prompt {self.index}: exactly one of text and messages must be set")
        if self.task == "code" and not self.tests:
            raise DataError(f"prompt {self.index}: a code prompt needs tests")

    def as_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text or ""}]

    def reward_answer(self) -> Any:
        """What ``RewardService.score`` compares a reply against for this prompt's task."""
        if self.task == "code":
            return {"tests": self.tests, "entry_point": self.entry_point, "prefix": self.code_prefix or ""}
        return self.answer
