"""The replay buffer: oldest admissible batch first, stale groups dropped and counted."""
from __future__ import annotations

import pytest

from megatron_areal.records import Group, Trajectory
from megatron_areal.rollout.buffer import PutResult, ReplayBuffer


def group(gid: int, version: int, rewards=(0.0, 1.0)) -> Group:
    trajs = [Trajectory(prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5], output_versions=[version],
                        start_version=version, group_id=gid, prompt_index=100 + gid, reward=r)
             for r in rewards]
    return Group(group_id=gid, prompt_index=100 + gid, trajectories=trajs)


def test_take_returns_oldest_and_drops_stale():
    buf = ReplayBuffer(eta=2)
    for gid, v in [(0, 3), (1, 1), (2, 0), (3, 2), (4, 3)]:
        assert buf.put(group(gid, v), version=2) is PutResult.ACCEPTED
    batch, dropped = buf.take(version=3, batch_size=2)
    assert [g.group_id for g in dropped] == [2]  # 3 - 0 > 2
    assert [g.group_id for g in batch] == [1, 3]  # versions 1 and 2: the oldest admissible
    assert buf.dropped_stale == 1 and len(buf) == 2
    for g in batch:
        assert 3 - g.start_version <= 2


def test_take_waits_for_full_batch_and_keeps_contents():
    buf = ReplayBuffer(eta=0)
    buf.put(group(0, 5), version=5)
    batch, dropped = buf.take(version=5, batch_size=2)
    assert batch is None and dropped == [] and len(buf) == 1


def test_put_refuses_stale_and_filters_equal_rewards():
    buf = ReplayBuffer(eta=1, filter_equal_rewards=True)
    assert buf.put(group(0, 0), version=2) is PutResult.STALE
    assert buf.put(group(1, 2, rewards=(1.0, 1.0)), version=2) is PutResult.FILTERED
    assert buf.put(group(2, 2, rewards=(0.0, 0.0, 0.0)), version=2) is PutResult.FILTERED
    assert buf.put(group(3, 2, rewards=(0.0, 1.0)), version=2) is PutResult.ACCEPTED
    assert (buf.dropped_stale, buf.filtered, len(buf)) == (1, 2, 1)
    unfiltered = ReplayBuffer(eta=1, filter_equal_rewards=False)
    assert unfiltered.put(group(1, 2, rewards=(1.0, 1.0)), version=2) is PutResult.ACCEPTED


def test_state_dict_round_trip():
    buf = ReplayBuffer(eta=3)
    for gid in range(3):
        buf.put(group(gid, gid), version=2)
    buf.drop_stale(version=4)  # group 0 is 4 versions old
    fresh = ReplayBuffer(eta=3)
    fresh.load_state_dict(buf.state_dict())
    assert fresh.prompt_indices() == [101, 102] and fresh.dropped_stale == 1
    batch, _ = fresh.take(version=4, batch_size=2)
    assert [g.group_id for g in batch] == [1, 2]
    assert batch[0].trajectories[0].output_versions == [1]


def test_empty_group_is_an_error():
    with pytest.raises(ValueError, match="no trajectories"):
        ReplayBuffer(eta=0).put(Group(group_id=7, prompt_index=0), version=0)
