"""A shard push whose sender dies or freezes mid-push ends within the timeout, naming the sender.

A real embedded server receives a two-sender manifest (``/update_weights_from_shards``) over gloo: this
process is sender 0 and sends its slice; sender 1 is a real process that joined the group and is then
killed (or stopped: its sockets stay open and nothing arrives). The server's reply must come within its
timeout (plus the HTTP overhead) and name trainer rank 1; its weights and version stay what they were.
(A receiver that dies mid-push is ``test_realloc.test_killed_server_is_dropped_and_sync_goes_on``.)
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist

SENDER = """
import sys, time
from megatron_areal.weights.wire import WeightUpdateGroup
g = WeightUpdateGroup(master_address="127.0.0.1", master_port=int(sys.argv[1]), rank=1, world_size=3,
                      group_name="dying", timeout_s=60)
print("JOINED", flush=True)
time.sleep(600)  # never sends: the test kills or stops this process
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("shard-failure") / "model", "llama", seed=5)
    running = start_embedded(model, args=["--weight-version", "init"])
    try:
        yield running
    finally:
        running.stop()


def _checksums(url: str) -> dict:
    with urllib.request.urlopen(url + "/weights_checksum", timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_silent_sender_is_named_within_the_timeout(server, how: str) -> None:
    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.util.netutil import free_port
    from megatron_areal.weights.endpoints import weight_calls
    from megatron_areal.weights.wire import WeightUpdateGroup

    url, timeout_s = server.url, 5.0
    before = _checksums(url)
    hidden = 64  # make_tiny_model's hidden size
    port = free_port("127.0.0.1")
    peer = subprocess.Popen([sys.executable, "-c", SENDER, str(port)], stdout=subprocess.PIPE, text=True)
    manifest = {"rounds": [[
        {"src": 0, "sender": "trainer rank 0 (pp0 tp0 dp0)", "slices": [["model.norm.weight", "float32", [hidden], 0,
                                                                          0, hidden]]},
        {"src": 1, "sender": "trainer rank 1 (pp0 tp1 dp0)", "slices": [["model.layers.0.input_layernorm.weight",
                                                                          "float32", [hidden], 0, 0, hidden]]}]]}

    async def go() -> tuple[str, float]:
        async with RolloutClient(url) as c:
            calls = weight_calls(c)
            await calls.begin_weight_update()
            init = asyncio.create_task(calls.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=2, world_size=3, group_name="dying"))
            group = await asyncio.to_thread(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                                            world_size=3, group_name="dying", timeout_s=60)
            await init
            assert peer.stdout is not None and peer.stdout.readline().strip() == "JOINED"
            update = asyncio.create_task(calls.update_weights_from_shards(
                manifest=manifest, senders=2, group_name="dying", weight_version="never", timeout_s=timeout_s))
            await asyncio.to_thread(lambda: dist.isend(torch.full((hidden,), 2.0), group=group.pg, group_dst=2,
                                                       tag=0).wait())
            peer.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(ServerError) as err:
                await update
            elapsed = time.monotonic() - start
            group.destroy()
            await calls.destroy_weights_update_group("dying")
            await calls.end_weight_update()
            return str(err.value), elapsed

    try:
        message, elapsed = asyncio.run(go())
    finally:
        peer.kill()
        peer.wait(timeout=30)
    assert "trainer rank 1 (pp0 tp1 dp0)" in message, message
    assert elapsed < timeout_s + 30, elapsed
    after = _checksums(url)
    assert after["weight_version"] == "init"
    assert after["checksums"]["model.layers.0.input_layernorm.weight"] == \
        before["checksums"]["model.layers.0.input_layernorm.weight"]


def test_manifest_that_cannot_describe_a_receive_is_refused_before_any(server) -> None:
    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.weights.endpoints import weight_calls

    bad = [({"rounds": [[{"src": 5, "slices": []}]]}, "src"),
           ({"rounds": [[{"src": 0, "slices": [["model.norm.weight", "float32", [64], 0, 10, 99]]}]]}, "outside"),
           ({"rounds": [[{"src": 0, "slices": [["x", "float32", [2**40, 2**20], 0, 0, 2**40]]}]]}, "exceed"),
           # integer or boolean slices would truncate the weights they replace
           ({"rounds": [[{"src": 0, "slices": [["model.norm.weight", "int64", [64], 0, 0, 64]]}]]}, "floating"),
           ({"rounds": [[{"src": 0, "slices": [["model.norm.weight", "bool", [64], 0, 0, 64]]}]]}, "floating")]

    async def go() -> list[str]:
        out = []
        async with RolloutClient(url := server.url) as c:
            calls = weight_calls(c)
            await calls.begin_weight_update()
            for manifest, _ in bad:
                with pytest.raises(ServerError) as err:
                    await calls.update_weights_from_shards(manifest=manifest, senders=1, group_name="none-yet",
                                                           weight_version=None, timeout_s=5)
                out.append(str(err.value))
            await calls.end_weight_update()
        assert url
        return out

    for message, (_, word) in zip(asyncio.run(go()), bad, strict=True):
        assert word in message, message
