"""The resumable training prompt stream.

Prompts come in a seeded order, a fresh permutation each epoch. ``state_dict`` holds the epoch,
the position inside it and the re-queued indices, so a restored stream continues exactly where
the saved one stood. Prompts that were handed out but not finished when the checkpoint was taken
(in flight on the rollout servers) are given back with ``push_back`` after restoring; they are
yielded again before anything new, so after a restart no prompt is lost or used twice.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from megatron_areal.data.prompt import DataError, Prompt


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """Identifies the dataset a saved position refers to."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p.index, p.text, p.messages, str(p.answer), p.task]).encode())
    return digest.hexdigest()[:16]


class PromptStream(Iterator[Prompt]):
    def __init__(self, prompts: Sequence[Prompt], seed: int = 0, shuffle: bool = True) -> None:
        if not prompts:
            raise DataError("the prompt stream needs at least one prompt")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # next slot of the current epoch's order
        self._pending: deque[int] = deque()
        self._order = self._epoch_order(0)
        self._fingerprint = fingerprint(prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"prompt-stream/{self.seed}/{epoch}").shuffle(order)
        return order

    def __next__(self) -> Prompt:
        if self._pending:
            return self.prompts[self._pending.popleft()]
        if self.position == len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return self.prompts[index]

    def take(self, n: int) -> list[Prompt]:
        return [next(self) for _ in range(n)]

    def push_back(self, indices: Iterable[int]) -> None:
        """Re-queue prompts by index (in-flight ones after a restart); they come next, in this order."""
        indices = list(indices)
        bad = [i for i in indices if not 0 <= i < len(self.prompts)]
        if bad:
            raise DataError(f"push_back: indices {bad[:5]} outside the dataset of {len(self.prompts)} prompts")
        self._pending.extend(indices)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "pending": list(self._pending), "size": len(self.prompts), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"seed": self.seed, "shuffle": self.shuffle, "size": len(self.prompts),
                    "fingerprint": self._fingerprint}
        for key, value in expected.items():
            if state.get(key) != value:
                raise DataError(f"saved prompt stream does not match this dataset: {key} is {state.get(key)!r} "
                                f"in the checkpoint but {value!r} now (different data or data.seed?)")
        if not 0 <= state["position"] <= len(self.prompts) or state["epoch"] < 0:
            raise DataError(f"saved prompt stream position {state['epoch']}:{state['position']} is invalid")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
        self._pending = deque()
        self.push_back(state["pending"])
