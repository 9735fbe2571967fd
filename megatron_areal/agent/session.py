"""One episode's record: the turns its agent asked for, each with the tokens, logprobs and versions.

The endpoint appends a ``Turn`` per completion; ``to_trajectories`` reads them. Limits are checked
here, before a turn is generated: at most ``max_turns`` completions, and no sequence longer than
``max_tokens`` (prompt plus reply: what the trainer would have to hold).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_areal.agent.render import Message, PreviousTurn


class LimitReached(RuntimeError):
    """The episode may not have another turn; the message says which limit."""


@dataclass
class Turn:
    """One completion: its prompt and reply tokens, the reply's behaviour logprobs and per-token versions."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    extends: bool  # prompt_ids begin with the previous turn's prompt + output
    finish_reason: str = ""
    interruptions: int = 0
    tool_calls: int = 0  # calls parsed from the reply
    malformed_call: bool = False


@dataclass
class EpisodeSession:
    """The turns of one episode so far, and what the next turn may extend."""

    episode_id: str
    max_turns: int
    max_tokens: int
    max_new_tokens: int  # per turn
    turns: list[Turn] = field(default_factory=list)
    previous: PreviousTurn | None = None
    closed: str = ""  # why no more turns are served (set when the episode ends)

    def budget(self, prompt_len: int, wanted: int) -> int:
        """New tokens the next turn may generate (at most ``wanted`` and ``max_new_tokens``); raises
        ``LimitReached``."""
        if self.closed:
            raise LimitReached(f"episode {self.episode_id} is over ({self.closed})")
        if len(self.turns) >= self.max_turns:
            raise LimitReached(f"episode {self.episode_id}: max_turns={self.max_turns} reached")
        room = self.max_tokens - prompt_len
        if room < 1:
            raise LimitReached(f"episode {self.episode_id}: prompt of {prompt_len} tokens leaves no room under "
                               f"max_episode_tokens={self.max_tokens}")
        return min(wanted, self.max_new_tokens, room)

    def record(self, turn: Turn, messages: list[Message], reply: Message) -> None:
        if self.closed:  # the episode ended (say, timed out) while this turn was generating
            return
        self.turns.append(turn)
        self.previous = PreviousTurn(messages=tuple(messages), reply=reply,
                                     sequence=tuple(turn.prompt_ids + turn.output_ids))

    def stats(self) -> dict[str, Any]:
        return {"turns": len(self.turns), "tool_calls": sum(t.tool_calls for t in self.turns),
                "malformed_calls": sum(t.malformed_call for t in self.turns),
                "extended_turns": sum(t.extends for t in self.turns[1:])}
