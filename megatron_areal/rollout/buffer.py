"""The replay buffer: scored groups waiting for the trainer.

The trainer at policy version ``v`` may train a group only if ``v - group.start_version <= eta``
(admissible). ``take`` first removes every group that is no longer admissible (they are returned
and counted, never trained), then hands out the ``batch_size`` oldest groups: lowest start
version first, arrival order among equals, so nothing waits long enough to go stale while
newer work is trained. Groups whose rewards are all equal carry no signal for group-relative
advantages; with ``filter_equal_rewards`` they are refused at ``put`` and counted. A group's samples
are its episodes (``Trajectory.episode``): an agent episode split into several trajectories is one.
"""
from __future__ import annotations

import threading
from enum import Enum
from typing import Any

from megatron_areal.records import Group


class PutResult(Enum):
    """What ``ReplayBuffer.put`` did with a group."""

    ACCEPTED = "accepted"
    FILTERED = "filtered"  # all rewards equal
    STALE = "stale"  # already too old to ever be trained


class ReplayBuffer:
    """Thread-safe store of finished groups with the admission rule of the staleness bound."""

    def __init__(self, eta: int, filter_equal_rewards: bool = False) -> None:
        self.eta = eta  # checked where the run configures it (``StalenessConfig.validate``) and by the gate
        self.filter_equal_rewards = filter_equal_rewards
        self._groups: list[tuple[int, Group]] = []  # (arrival sequence number, group)
        self._seq = 0
        self._lock = threading.Lock()
        self.dropped_stale = 0
        self.filtered = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def admissible(self, group: Group, version: int) -> bool:
        """Whether ``group`` may still be trained at ``version``: at most ``eta`` versions old."""
        return version - group.start_version <= self.eta

    def put(self, group: Group, version: int) -> PutResult:
        """Store a finished group unless it is already too old, or (with ``filter_equal_rewards``) all its
        rewards are equal and it carries no signal."""
        if not group.trajectories:
            raise ValueError(f"group {group.group_id} has no trajectories")
        with self._lock:
            if not self.admissible(group, version):
                self.dropped_stale += 1
                return PutResult.STALE
            rewards = group.episode_rewards
            if self.filter_equal_rewards and len(rewards) > 1 and max(rewards) == min(rewards):
                self.filtered += 1
                return PutResult.FILTERED
            self._groups.append((self._seq, group))
            self._seq += 1
            return PutResult.ACCEPTED

    def drop_stale(self, version: int) -> list[Group]:
        """Remove and return the groups no longer admissible at ``version`` (counted)."""
        with self._lock:
            keep = [(s, g) for s, g in self._groups if self.admissible(g, version)]
            stale = [g for s, g in self._groups if not self.admissible(g, version)]
            self._groups = keep
            self.dropped_stale += len(stale)
            return stale

    def count_admissible(self, version: int) -> int:
        """Groups that could be trained at ``version``."""
        with self._lock:
            return sum(self.admissible(g, version) for _, g in self._groups)

    def take(self, version: int, batch_size: int) -> tuple[list[Group] | None, list[Group]]:
        """``(batch or None, dropped)``: drop the stale groups, then pop the oldest ``batch_size``
        admissible ones if there are that many (else leave the buffer as it is)."""
        dropped = self.drop_stale(version)
        with self._lock:
            if len(self._groups) < batch_size:
                return None, dropped
            order = sorted(self._groups, key=lambda sg: (sg[1].start_version, sg[0]))
            chosen = {s for s, _ in order[:batch_size]}
            batch = [g for s, g in order[:batch_size]]
            self._groups = [(s, g) for s, g in self._groups if s not in chosen]
            return batch, dropped

    def prompt_indices(self) -> list[int]:
        """The dataset indices of the stored groups' prompts."""
        with self._lock:
            return [g.prompt_index for _, g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """The stored groups and the drop counters, for a checkpoint."""
        with self._lock:
            return {"groups": [g.to_dict() for _, g in self._groups],
                    "dropped_stale": self.dropped_stale, "filtered": self.filtered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a ``state_dict``; arrival order restarts in the stored order."""
        with self._lock:
            groups = [Group.from_dict(g) for g in state["groups"]]
            self._groups = list(enumerate(groups))
            self._seq = len(groups)
            self.dropped_stale = int(state["dropped_stale"])
            self.filtered = int(state["filtered"])
