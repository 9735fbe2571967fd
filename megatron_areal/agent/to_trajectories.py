"""An episode's turns -> trajectories with a per-position loss mask.

Turns chain while each one's prompt extends the previous turn's prompt and reply token for token
(``Turn.extends``, decided by ``render``). A chain is one trajectory: the first turn's prompt is its
prompt; its output is the first reply, then for every later turn the tokens the environment added
(tool results, a user message, the template's headers: mask 0, logprob 0, the version of the reply
before them) and that turn's reply (mask 1, the server's logprobs and versions). A turn that does
not extend starts a new chain, so an episode whose history was edited becomes one trajectory per
unbroken run of turns, each carrying the episode's reward and its ``episode`` id, so that the group's
advantages count the episode once however many trajectories it became (``Trajectory.episode``).

The staleness gate judges a trajectory by its oldest token: ``start_version`` is the smallest
version of any reply token, or the version the episode started at if that is smaller.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_areal.agent.session import Turn
from megatron_areal.records import Trajectory


@dataclass(frozen=True)
class EpisodeShape:
    """How an episode's turns were laid out: turns, trajectories, turns that extended the previous one."""

    turns: int
    trajectories: int
    extended: int


def chains(turns: Sequence[Turn]) -> list[list[Turn]]:
    """Runs of turns where each extends the one before; a turn with no reply tokens ends its run."""
    out: list[list[Turn]] = []
    for turn in turns:
        if out and turn.extends and out[-1][-1].output_ids:
            out[-1].append(turn)
        else:
            out.append([turn])
    return out


def chain_trajectory(chain: Sequence[Turn], *, start_version: int, reward: float, group_id: int, episode: int,
                     prompt_index: int, answer: object, task: str) -> Trajectory:
    """One trajectory for turns that extend each other (``chains``)."""
    first = chain[0]
    ids, logprobs = list(first.output_ids), list(first.output_logprobs)
    versions, mask = list(first.output_versions), [1] * len(first.output_ids)
    sequence = first.prompt_ids + first.output_ids
    for turn in chain[1:]:
        if turn.prompt_ids[:len(sequence)] != sequence:
            raise ValueError(f"turn marked as extending does not start with the previous {len(sequence)} tokens")
        added = turn.prompt_ids[len(sequence):]
        last = versions[-1] if versions else start_version
        ids += added + turn.output_ids
        logprobs += [0.0] * len(added) + turn.output_logprobs
        versions += [last] * len(added) + turn.output_versions
        mask += [0] * len(added) + [1] * len(turn.output_ids)
        sequence = turn.prompt_ids + turn.output_ids
    generated = [v for v, m in zip(versions, mask) if m]
    return Trajectory(prompt_ids=list(first.prompt_ids), output_ids=ids, output_logprobs=logprobs,
                      output_versions=versions, output_mask=mask,
                      start_version=min([start_version, *generated]), group_id=group_id, episode=episode,
                      prompt_index=prompt_index, answer=answer, task=task, reward=reward,
                      finish_reason=chain[-1].finish_reason, interruptions=sum(t.interruptions for t in chain))


def episode_trajectories(turns: Sequence[Turn], *, start_version: int, reward: float, group_id: int,
                         episode: int, prompt_index: int, answer: object = None,
                         task: str = "agent") -> tuple[list[Trajectory], EpisodeShape]:
    """Trajectories of one episode (none when it generated nothing), and how they were laid out.

    ``episode`` must tell this episode apart from the others of group ``group_id`` (its index there)."""
    if episode < 0:
        raise ValueError(f"episode id must be >= 0 (it ties the episode's trajectories together), got {episode}")
    runs = [c for c in chains(turns) if any(t.output_ids for t in c)]
    trajectories = [chain_trajectory(c, start_version=start_version, reward=reward, group_id=group_id,
                                     episode=episode, prompt_index=prompt_index, answer=answer, task=task)
                    for c in runs]
    extended = sum(len(c) - 1 for c in runs)
    return trajectories, EpisodeShape(turns=len(turns), trajectories=len(trajectories), extended=extended)
