"""The trainer's weight path and client, checked against SGLang 0.5.23's own code (CPU, gloo).

The SGLang side is ``sglang_receiver``: SGLang's request classes, its
``init_custom_process_group``, its ``FlattenedTensorBucket`` and its weight-version spans,
loaded from the installed wheel. What cannot be run here (the scheduler, the model runner and
NCCL itself need CUDA) is named in that module's docstring.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from netutil import free_ports

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent


# ---- receivers -------------------------------------------------------------------------------
class ReceiverProcess:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, str(HERE / "sglang_receiver.py"), str(port)], cwd=HERE)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited with code {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"receiver {self.url} not ready in {timeout_s:.0f}s")

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def start_receivers(n: int) -> list[ReceiverProcess]:
    receivers = [ReceiverProcess(port) for port in free_ports(n)]
    for r in receivers:
        r.wait_ready()
    return receivers


@pytest.fixture
def receivers(request: pytest.FixtureRequest) -> Iterator[list[ReceiverProcess]]:
    started = start_receivers(getattr(request, "param", 2))
    yield started
    for r in started:
        r.stop()


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Odd sizes and mixed dtypes: a 3-element bf16 tensor leaves the next fp32 one unaligned."""
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("b.weight", torch.randn(5, 7, generator=g)),
            ("c.bias", torch.randn(11, generator=g).to(torch.float16)),
            ("d.weight", torch.randn(64, 33, generator=g)),
            ("e.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16))]


def sha(t: torch.Tensor) -> str:
    from megatron_areal.server.weights import tensor_checksum
    return tensor_checksum(t)


# ---- the weight-update group -----------------------------------------------------------------
@pytest.mark.parametrize("flat", [True, False], ids=["flattened", "per-tensor"])
def test_stage_link_meets_sglang_receivers_bitwise(receivers: list[ReceiverProcess], flat: bool) -> None:
    """Our group (rank 0) + SGLang's ``init_custom_process_group`` on the servers: every tensor
    arrives bitwise, through SGLang's own bucket reconstruction."""
    _send_and_check(receivers, flat)


@pytest.mark.parametrize("receivers", [1], indirect=True)
def test_stage_link_from_a_torchrun_rank_meets_sglang(receivers: list[ReceiverProcess],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-rank trainer runs under torchrun, which sets ``TORCHELASTIC_USE_AGENT_STORE=True``;
    torch's ``tcp://`` rendezvous then makes every rank a client of the agent's store, so the
    trainer, rank 0 of the weight group, must host the group's store itself."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    _send_and_check(receivers, flat=True)


def _send_and_check(receivers: list[ReceiverProcess], flat: bool) -> None:
    from megatron_areal.fleet.fleet import Fleet
    from megatron_areal.weights.buckets import pack_buckets
    from megatron_areal.weights.endpoints import weight_calls
    from megatron_areal.weights.link import StageLink

    tensors = mixed_tensors()
    pool = Fleet(control_timeout_s=60)
    link = StageLink(pool, {r.url: 1 for r in receivers}, stage=0, generation=1, master_address="127.0.0.1",
                     backend="gloo", timeout_s=60)
    try:
        assert link.form() == {}
        assert not pool.each(link.urls, lambda c: weight_calls(c).begin_weight_update())
        for bucket in pack_buckets(iter(tensors), bucket_bytes=4096, flat=flat):
            assert link.send(bucket, "7") == {}
        assert not pool.each(link.urls, lambda c: weight_calls(c).end_weight_update())
        link.destroy(link.urls)
    finally:
        pool.close()
    want = {name: sha(t) for name, t in tensors}
    for r in receivers:
        got = r.get("/weights_checksum")
        assert got["weight_version"] == "7"
        assert {n: v["sha256"] for n, v in got["checksums"].items()} == want


def _sglang_side(port: int, name: str, out: Any) -> None:
    import sglang_ref

    try:
        sglang_ref.init_custom_process_group()(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                               rank=1, group_name=name, timeout=timedelta(seconds=6))
        out.put("joined")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(f"{type(e).__name__}")


def test_group_on_other_store_keys_is_caught_within_a_timeout() -> None:
    """The control: a group built on ``PrefixStore(group_name)`` directly (the construction this
    project used before) never meets SGLang's; the check ends in seconds instead of hanging."""
    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    (port,) = free_ports(1)
    proc = ctx.Process(target=_sglang_side, args=(port, "g", out))
    proc.start()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=6),
                          wait_for_workers=False)
    with pytest.raises(RuntimeError):
        dist.ProcessGroupGloo(dist.PrefixStore("g", store), 0, 2, timedelta(seconds=6))
    assert out.get(timeout=30) != "joined"
    proc.join(30)


# ---- request and response bodies ---------------------------------------------------------------
@pytest.mark.parametrize("receivers", [1], indirect=True)
def test_every_client_body_is_a_valid_sglang_request(receivers: list[ReceiverProcess]) -> None:
    """Each body the client sends parses with SGLang's request class for that endpoint (unknown
    fields refused), and the reply's per-token versions follow SGLang's own spans."""
    from megatron_areal.fleet.client import RolloutClient
    from megatron_areal.weights.endpoints import weight_calls

    url = receivers[0].url

    async def drive() -> Any:
        async with RolloutClient(url) as c:
            result = await c.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0.7, "top_p": 1.0,
                                                  "top_k": -1, "stop_token_ids": [2]}, rid="q-1")
            await c.pause("abort")
            await c.abort("q-1")
            await c.abort_all()
            await weight_calls(c).begin_weight_update()
            await weight_calls(c).update_weights_from_disk("/nonexistent", weight_version="3")
            await weight_calls(c).end_weight_update()
            await c.resume()
            await c.flush_cache()
            return result

    result = asyncio.run(drive())
    assert result.output_versions == ["previous", "previous", "default"]
    assert result.weight_version == "default" and result.finish_reason == "length"
    assert len(result.output_logprobs) == 3
    paths = [e["path"] for e in receivers[0].get("/received")["received"]]
    assert paths == ["/generate", "/pause_generation", "/abort_request", "/abort_request", "/begin_weight_update",
                     "/update_weights_from_disk", "/end_weight_update", "/continue_generation"]


@pytest.mark.parametrize("receivers", [1], indirect=True)
def test_receiver_refuses_fields_sglang_does_not_know(receivers: list[ReceiverProcess]) -> None:
    """The check can fail: a body with a field SGLang lacks, or a wrong type, is refused."""
    from megatron_areal.fleet.client import RolloutClient, ServerError

    async def drive() -> list[str]:
        errors = []
        async with RolloutClient(receivers[0].url) as c:
            for endpoint, body in [("/pause_generation", {"mode": "abort", "timeout": 3}),
                                   ("/update_weight_version", {"new_version": 4}),
                                   ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "lora_alpha": 2}),
                                   ("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}})]:
                try:
                    await c.request("POST", endpoint, body)
                except ServerError as e:
                    errors.append(str(e))
        return errors

    assert len(asyncio.run(drive())) == 4


@pytest.mark.parametrize("receivers", [1], indirect=True)
def test_lora_adapter_calls_are_valid_sglang_requests(receivers: list[ReceiverProcess], tmp_path: Path) -> None:
    """``/load_lora_adapter`` and ``/unload_lora_adapter`` parse with SGLang's ``LoadLoRAAdapterReqInput`` and
    ``UnloadLoRAAdapterReqInput`` (unknown fields refused), and a generate request names the adapter in SGLang's
    ``lora_path`` field; a name loaded twice comes back as the client's error."""
    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.weights.endpoints import weight_calls

    folder = str(tmp_path / "adapter-v3")

    async def drive() -> str:
        async with RolloutClient(receivers[0].url) as c:
            await weight_calls(c).load_lora_adapter("policy-v3", folder)
            await c.generate([5, 6], {"max_new_tokens": 2}, lora_path="policy-v3")
            try:
                await weight_calls(c).load_lora_adapter("policy-v3", folder)
            except ServerError as e:
                refused = str(e)
            await weight_calls(c).unload_lora_adapter("policy-v3")
            return refused

    assert "already loaded" in asyncio.run(drive())
    received = receivers[0].get("/received")["received"]
    assert [e["path"] for e in received] == ["/load_lora_adapter", "/generate", "/load_lora_adapter",
                                             "/unload_lora_adapter"]
    assert received[0]["body"] == {"lora_name": "policy-v3", "lora_path": folder, "pinned": False}
    assert received[1]["body"]["lora_path"] == "policy-v3"


# ---- pipeline stages against several servers -----------------------------------------------------
def _w_push_pp2(model_dir: str, urls: list[str], version: str) -> list[str]:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    groups = init_parallel(tp=1, pp=2, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp)
    config = WeightsConfig(bucket_mb=0.05, timeout_s=60.0, master_address="127.0.0.1")
    sync = WeightSync(chunks, arch, groups, urls, config=config, engine="sglang")  # the stage heads' path
    try:
        return sync.sync(version).servers
    finally:
        sync.close()
        teardown_parallel()


@pytest.mark.parametrize("receivers", [2, 3], indirect=True)
def test_pipeline_stages_reach_sglang_servers_that_take_one_operation_at_a_time(receivers: list[ReceiverProcess],
                                                                                tmp_path: Path) -> None:
    """PP2 trainer, servers that each take one weight operation at a time, in arrival order: every server
    gets every tensor bitwise from both stages. Two servers (no more than the stages): both stages stream at
    once, each head over its own group with each server, and nothing deadlocks. Three: one group per stage
    with all servers in it, and every server sees stage 0's group entirely before stage 1's (two such
    groups streaming at once is what deadlocks: a server inside one stage's broadcast waits for another
    that is inside the other stage's)."""
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.model.assets import make_tiny_model
    from megatron_areal.server.weights import read_safetensors

    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    urls = [r.url for r in receivers]
    pool = WorkerPool(2, timeout_s=180)
    try:
        servers = pool.run(_w_push_pp2, str(model), urls, "1")
    finally:
        pool.close()
    assert servers == [urls, urls]
    want = {n: sha(t) for n, t in read_safetensors(model).items()}
    orders, groups = [], []
    for r in receivers:
        got = {n: v["sha256"] for n, v in r.get("/weights_checksum")["checksums"].items()}
        assert set(want) - set(got) <= {"lm_head.weight"}
        assert got == {n: want[n] for n in got}
        updates = r.get("/received")["updates"]
        orders.append([int(name.split("-")[1].removeprefix("stage")) for name in updates])
        groups.append(set(updates))
    assert all(set(order) == {0, 1} for order in orders), orders
    if len(receivers) <= 2:  # a group per (stage, server): no two servers share one
        assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1:]), groups
    else:
        assert all(order == orders[0] for order in orders), orders
        assert orders[0] == sorted(orders[0]), orders[0]


# ---- liveness while paused ---------------------------------------------------------------------
def _w_sync_one_rank(model_dir: str, urls: list[str], version: str) -> dict[str, Any]:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.fleet.fleet import Fleet
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync, WeightSyncError

    groups = init_parallel(tp=1, pp=1, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, 0, 1)
    # as the trainer does: a server the push drops leaves the fleet its rollouts route over
    fleet = Fleet(urls, engine="sglang", control_timeout_s=60.0)
    sync = WeightSync(chunks, arch, groups, urls, config=WeightsConfig(timeout_s=60.0, master_address="127.0.0.1"),
                      fleet=fleet)
    try:
        result = sync.sync(version)
        return {"servers": result.servers, "routed": fleet.urls, "removed": fleet.routing.removed}
    except WeightSyncError as e:
        return {"error": str(e), "servers": list(sync.servers), "routed": fleet.urls, "removed": fleet.routing.removed}
    finally:
        sync.close()
        fleet.close()
        teardown_parallel()


def test_a_paused_server_that_refuses_an_update_is_not_taken_for_dead(receivers: list[ReceiverProcess],
                                                                      tmp_path: Path) -> None:
    """While paused, SGLang's ``/health`` waits (20 s, then 503); liveness must not depend on it.
    A server that refuses a bucket is alive: the sync fails naming it, nothing is dropped."""
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", seed=5)
    urls = [r.url for r in receivers]
    urllib.request.urlopen(urllib.request.Request(urls[1] + "/test/refuse_next_update", method="POST"), timeout=10)
    pool = WorkerPool(1, timeout_s=180)
    try:
        (outcome,) = pool.run(_w_sync_one_rank, str(model), urls, "1")
    finally:
        pool.close()
    assert outcome["removed"] == 0 and outcome["servers"] == outcome["routed"] == urls, outcome
    assert "refused" in outcome["error"] and urls[1] in outcome["error"], outcome
