"""The simulator's price of a weight push (``sim/push.py``): a hand-computed example, and the property the
shard-to-shard plan exists for (its time falls as trainer ranks are added; the stage heads' does not)."""
from __future__ import annotations

import pytest

from megatron_areal.model.arch import ModelArch
from megatron_areal.model.counts import param_count
from megatron_areal.sim.push import Links, price, push_estimate
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, make_plan

GB = 1e9
DENSE = ModelArch(model_type="qwen2", vocab_size=4096, hidden_size=512, intermediate_size=2048, num_layers=8,
                  num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=1e4, rope_scaling=None, qkv_bias=True, qk_norm=False, tie_word_embeddings=False)


def test_two_senders_into_one_receiver_by_hand() -> None:
    # two trainer ranks send 1 GB each to one server rank over 10 GB/s links: each sender is busy 0.1 s, the
    # receiver takes 2 GB, 0.2 s. Converting at 5 GB/s costs each sender 0.2 s, overlapped with its 0.1 s on
    # the wire a 0.25 GB bucket at a time: 0.2 + 0.025 = 0.225 s, which bounds the push.
    sent = {0: (GB, 0.1), 1: (GB, 0.1)}
    received = {(0, 0): (2 * GB, 0.2)}
    fast = price(sent, received, convert=1e15, bucket_bytes=int(0.25 * GB), bandwidth_of=lambda r: 10 * GB)
    assert fast.seconds == pytest.approx(0.2)
    assert fast.bound == "server 0 rank 0"
    slow = price(sent, received, convert=5 * GB, bucket_bytes=int(0.25 * GB), bandwidth_of=lambda r: 10 * GB)
    assert slow.seconds == pytest.approx(0.225) and slow.bound == "trainer rank 0"


def test_plan_bytes_over_nvlink_by_hand() -> None:
    # TP2 trainer, one server at TP1 on the same node: the two ranks send the whole model between them, the
    # server rank receives all of it (bf16: 2 bytes a parameter), so at 100 GB/s the push is model / 100 GB/s.
    plan = make_plan(DENSE, TrainerLayout(tp=2), ServerLayout(1, 1), dtype_bytes=2)
    links = Links(nvlink=100 * GB, ib=10 * GB, gloo=1 * GB, convert=1e18, gpus_per_node=8)
    est = push_estimate(plan, links, bucket_bytes=1)
    model_bytes = 2 * param_count(DENSE)
    assert est.busiest_receiver_bytes == model_bytes
    assert est.seconds == pytest.approx(model_bytes / (100 * GB), rel=1e-6)
    # the same server on another node: InfiniBand, ten times slower
    far = Links(nvlink=100 * GB, ib=10 * GB, gloo=1 * GB, convert=1e18, gpus_per_node=2)
    assert push_estimate(plan, far, bucket_bytes=1).seconds == pytest.approx(model_bytes / (10 * GB), rel=1e-6)


def test_shard_to_shard_falls_with_more_trainer_ranks_and_stage_heads_do_not() -> None:
    # 8 servers at TP4, each rank needing its TP range; NVLink only, so only the bytes per rank matter
    links = Links(nvlink=100 * GB, ib=100 * GB, gloo=1 * GB, convert=50 * GB, gpus_per_node=1024)
    servers = ServerLayout(8, 4, sharded=True)
    shard, heads = [], []
    for tp, dp in ((1, 1), (2, 1), (4, 1), (4, 2), (4, 4)):
        plan = make_plan(DENSE, TrainerLayout(tp=tp, pp=2, dp=dp), servers)
        shard.append(push_estimate(plan, links, bucket_bytes=1 << 20).seconds)
        heads.append(push_estimate(plan, links, bucket_bytes=1 << 20, stage_head=True).seconds)
    assert all(a > b for a, b in zip(shard, shard[1:])), shard
    assert max(heads) == pytest.approx(min(heads)), heads
    # a pipelined broadcast puts a stage's bytes on each link once, point to point sends a copy per server, so
    # the stage heads win with few trainer ranks and lose once enough ranks share the sending
    assert shard[0] > heads[0] and shard[-1] < heads[-1], (shard, heads)
