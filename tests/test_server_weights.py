"""The embedded server's weight endpoints, held to what SGLang 0.5.23 does where the protocol leaves room.

Real server processes on 127.0.0.1 and real gloo groups (the trainer's end is a
``WeightUpdateGroup`` at rank 0 in this process). Every wait is bounded: a server that waits for
a broadcast it should have refused shows up as a client timeout, not as a hung test.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from netutil import http_call

from megatron_areal.launch.embedded import LocalServer, start_embedded
from megatron_areal.model.assets import make_tiny_model
from megatron_areal.server.weights import read_safetensors, tensor_checksum
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.wire import WeightUpdateGroup

pytestmark = pytest.mark.timeout(300)

HEALTH_TIMEOUT_S = 2.0  # the server's --health-timeout in these tests (SGLang's is 20 s)
GROUP_TIMEOUT_S = 30.0  # the server's --weight-group-timeout, unless a test needs a short one
QUICK_S = 10.0  # a refusal must come this fast: it may not wait for a broadcast


def call(url: str, path: str, body: Any = None, *, timeout: float = 60.0, method: str | None = None) -> tuple[int, Any]:
    return http_call(url, path, body, timeout=timeout, method=method)


def message(reply: Any) -> str:
    """The refusal text, whichever of SGLang's two error shapes the reply has."""
    if isinstance(reply, dict):
        inner = reply.get("error", reply)
        return str(inner.get("message", reply) if isinstance(inner, dict) else inner)
    return str(reply)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("weights-models")
    return (make_tiny_model(root / "a", "llama", seed=0), make_tiny_model(root / "b", "llama", seed=1))


def _start(model: Path, group_timeout_s: float = GROUP_TIMEOUT_S) -> LocalServer:
    return start_embedded(model, args=["--weight-version", "v0", "--health-timeout", str(HEALTH_TIMEOUT_S),
                                       "--weight-group-timeout", str(group_timeout_s)])


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]):
    srv = _start(models[0])
    yield srv
    srv.stop()


def checksums(url: str) -> dict[str, str]:
    return {k: v["sha256"] for k, v in call(url, "/weights_checksum")[1]["checksums"].items()}


def version(url: str) -> str:
    return call(url, "/model_info")[1]["weight_version"]


def join(url: str, name: str) -> WeightUpdateGroup:
    """Form a two-member group: this process is rank 0 (it hosts the store), the server rank 1."""
    port = free_port()
    with ThreadPoolExecutor(1) as ex:
        trainer = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                            world_size=2, group_name=name, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        status, reply = call(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"})
        group = trainer.result(timeout=GROUP_TIMEOUT_S)
    assert status == 200 and reply["success"], reply
    return group


def leave(url: str, group: WeightUpdateGroup) -> None:
    assert call(url, "/destroy_weights_update_group", {"group_name": group.group_name})[0] == 200
    group.destroy()


def bucket_meta(tensors: dict[str, torch.Tensor], group: str, **extra: Any) -> dict[str, Any]:
    return {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "group_name": group, **extra}


def announce(ex: ThreadPoolExecutor, url: str, path: str, body: dict[str, Any],
             timeout: float = 60.0) -> Future[tuple[int, Any]]:
    """POST in the background and give the request time to arrive (so arrival order is known)."""
    pending = ex.submit(call, url, path, body, timeout=timeout)
    time.sleep(0.5)
    return pending


# ---- begin/end bracket ----------------------------------------------------------------------
def test_updates_outside_begin_end_are_refused_without_joining_the_broadcast(server, models) -> None:
    url = server.url
    new = read_safetensors(models[1])
    one = {n: new[n] for n in sorted(new)[:1]}
    group = join(url, "bracket")
    before = checksums(url)
    try:
        # no broadcast follows: a server that joins it waits and the call times out
        status, reply = call(url, "/update_weights_from_distributed", bucket_meta(one, "bracket"), timeout=QUICK_S)
        assert status == 400 and reply["success"] is False and "begin_weight_update" in reply["message"], reply
        status, reply = call(url, "/update_weights_from_tensor", {"serialized_named_tensors": []}, timeout=QUICK_S)
        assert status == 400 and "begin_weight_update" in reply["message"], reply
        status, reply = call(url, "/end_weight_update", {}, timeout=QUICK_S)
        assert status == 400 and "begin_weight_update" in reply["message"], reply
        assert checksums(url) == before

        assert call(url, "/begin_weight_update", {"selector": "all"})[0] == 200
        status, reply = call(url, "/begin_weight_update", {"selector": "all"}, timeout=QUICK_S)
        assert status == 400 and "already open" in reply["message"], reply
        with ThreadPoolExecutor(1) as ex:
            pending = announce(ex, url, "/update_weights_from_distributed",
                               bucket_meta(one, "bracket", weight_version="v1"))
            group.broadcast(next(iter(one.values())).clone())
            assert pending.result(timeout=60)[0] == 200
        assert call(url, "/end_weight_update", {})[0] == 200
        assert checksums(url)[next(iter(one))] == tensor_checksum(next(iter(one.values())))
        assert version(url) == "v1"
    finally:
        leave(url, group)
        call(url, "/update_weights_from_disk", {"model_path": str(models[0]), "weight_version": "v0"})


def test_misaligned_flattened_bucket_is_refused_naming_the_tensor(server, models) -> None:
    url = server.url
    group = join(url, "aligned")
    before = checksums(url)
    # 3 bf16 values take 6 bytes, so the float32 tensor after them would start at byte 6
    body = {"names": ["model.norm.weight", "model.layers.0.input_layernorm.weight"],
            "dtypes": ["bfloat16", "float32"], "shapes": [[3], [3]], "group_name": "aligned",
            "load_format": "flattened_bucket", "weight_version": "bad"}
    try:
        assert call(url, "/begin_weight_update", {"selector": "all"})[0] == 200
        status, reply = call(url, "/update_weights_from_distributed", body, timeout=QUICK_S)
        assert status == 400 and reply["success"] is False, reply
        assert "model.layers.0.input_layernorm.weight" in reply["message"] and "offset 6" in reply["message"], reply
        assert checksums(url) == before and version(url) == "v0"
        # the group still works: the refusal never joined a collective
        good = {"model.norm.weight": torch.full((64,), 0.5)}
        with ThreadPoolExecutor(1) as ex:
            pending = announce(ex, url, "/update_weights_from_distributed",
                               bucket_meta(good, "aligned", load_format="flattened_bucket"))
            group.broadcast(good["model.norm.weight"].clone().view(torch.uint8))
            assert pending.result(timeout=60)[0] == 200
        assert checksums(url)["model.norm.weight"] == tensor_checksum(good["model.norm.weight"])
    finally:
        call(url, "/end_weight_update", {})
        leave(url, group)
        call(url, "/update_weights_from_disk", {"model_path": str(models[0]), "weight_version": "v0"})


# ---- one weight operation at a time, in arrival order ----------------------------------------
def test_weight_operations_run_one_at_a_time_in_arrival_order(server, models) -> None:
    """A disk update and a second group's join wait behind a pending broadcast, as SGLang's scheduler does."""
    url = server.url
    new = read_safetensors(models[1])
    first = join(url, "fifo-a")
    second_port = free_port()
    with ThreadPoolExecutor(4) as ex:
        assert call(url, "/begin_weight_update", {"selector": "all"})[0] == 200
        update = announce(ex, url, "/update_weights_from_distributed", bucket_meta(new, "fifo-a", weight_version="b"))
        disk = announce(ex, url, "/update_weights_from_disk", {"model_path": str(models[0]), "weight_version": "a"})
        trainer_b = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=second_port, rank=0,
                              world_size=2, group_name="fifo-b", backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        init_b = announce(ex, url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": second_port, "rank_offset": 1, "world_size": 2,
            "group_name": "fifo-b", "backend": "gloo"})
        time.sleep(1.0)
        try:
            assert not disk.done(), f"the disk update ran beside a pending broadcast: {disk.result()}"
            assert not init_b.done(), f"a second group was joined beside a pending broadcast: {init_b.result()}"
        finally:
            for name in new:  # release the queue whatever the outcome
                first.broadcast(new[name].clone())
        assert update.result(timeout=60)[0] == 200
        assert disk.result(timeout=60)[0] == 200
        assert init_b.result(timeout=60)[0] == 200
        second = trainer_b.result(timeout=60)
    assert call(url, "/end_weight_update", {})[0] == 200
    # the disk update came second, so its weights are the ones served
    assert checksums(url) == {n: tensor_checksum(t) for n, t in read_safetensors(models[0]).items()}
    assert version(url) == "a"
    leave(url, first)
    leave(url, second)
    call(url, "/update_weights_from_disk", {"model_path": str(models[0]), "weight_version": "v0"})


# ---- control endpoints are never queued behind weight-group work -----------------------------
def test_control_endpoints_answer_while_group_joins_hang(models) -> None:
    """More joins to an unreachable master than the server has default worker threads."""
    n = min(32, (os.cpu_count() or 1) + 4) + 1  # asyncio.to_thread's pool size, plus one
    dead_port = free_port()  # nothing listens there: each join retries until its timeout
    with _start(models[0], group_timeout_s=2.0) as srv, ThreadPoolExecutor(n) as ex:
        joins = [ex.submit(call, srv.url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": dead_port, "rank_offset": 1, "world_size": 2,
            "group_name": f"dead{i}", "backend": "gloo"}, timeout=240) for i in range(n)]
        time.sleep(1.0)
        started = time.monotonic()
        assert call(srv.url, "/abort_request", {"abort_all": True}, timeout=5)[0] == 200
        assert call(srv.url, "/pause_generation", {"mode": "abort"}, timeout=5)[0] == 200
        assert call(srv.url, "/continue_generation", {}, timeout=5)[0] == 200
        status, out = call(srv.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                           timeout=30)
        assert status == 200 and len(out["output_ids"]) == 2
        assert time.monotonic() - started < 30
        # each join gives up after the server's timeout and says where it tried
        status, reply = joins[0].result(timeout=60)
        assert status == 400 and reply["success"] is False and f"127.0.0.1:{dead_port}" in reply["message"], reply


def test_join_timeout_from_the_request_is_bounded(server) -> None:
    """A request may shorten the server's join timeout (never lengthen it); the wait ends with a 400."""
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "short", "backend": "gloo"}
    status, reply = call(server.url, "/init_weights_update_group", {**body, "timeout_s": 0}, timeout=QUICK_S)
    assert status == 400 and "timeout_s" in message(reply), reply
    start = time.monotonic()
    status, reply = call(server.url, "/init_weights_update_group", {**body, "timeout_s": 1}, timeout=GROUP_TIMEOUT_S)
    assert status == 400 and "short" in reply["message"], reply
    assert time.monotonic() - start < GROUP_TIMEOUT_S / 2  # the request's 1 s, not the server's 30 s


# ---- the group's membership --------------------------------------------------------------------
@pytest.mark.parametrize("fields,named", [
    ({"world_size": 1, "rank_offset": 0}, "world_size"),  # a one-member group: the server broadcasts to itself
    ({"world_size": 2, "rank_offset": 0}, "rank_offset"),  # collides with the trainer's rank 0
    ({"world_size": 2, "rank_offset": 2}, "rank_offset"),  # outside the group
    ({"world_size": 3, "rank_offset": -1}, "rank_offset"),
    ({"master_port": 0}, "master_port"),
    ({"master_port": 70000}, "master_port"),
    ({"group_name": ""}, "group_name"),
    ({"backend": "nccl"}, "backend"),  # this server runs on CPU
])
def test_impossible_groups_are_refused(server, fields: dict[str, Any], named: str) -> None:
    name = "refused-" + "-".join(f"{k}{v}" for k, v in fields.items())  # a join let through stays apart
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo", **fields}
    status, reply = call(server.url, "/init_weights_update_group", body, timeout=QUICK_S)
    assert status == 400 and named in message(reply), reply
    # nothing was joined under that name
    status, reply = call(server.url, "/destroy_weights_update_group", {"group_name": body["group_name"]})
    assert status == 400 and "no weight update group" in reply["message"]


def _listening(pid: int) -> list[str]:
    """``address:port`` of every TCP socket the process listens on (from /proc, no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].split(":")
                out.append(f"{_address(addr)}:{int(port, 16)}")
    return out


def _address(hex_addr: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word in host (little-endian) order
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def test_server_listens_only_on_its_host_after_joining(server) -> None:
    """The store is hosted by the trainer (rank 0); what the server itself opens stays on 127.0.0.1."""
    group = join(server.url, "listen")
    try:
        listening = _listening(server.proc.pid)
    finally:
        leave(server.url, group)
    assert listening, "the HTTP port at least"
    assert all(a.startswith(("127.0.0.1:", "::1:")) for a in listening), listening


# ---- /health while paused --------------------------------------------------------------------
def test_health_waits_while_paused_then_503(server) -> None:
    url = server.url
    assert call(url, "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        assert call(url, "/ready", timeout=5)[0] == 503
        start = time.monotonic()
        assert call(url, "/model_info", timeout=5)[0] == 200  # the liveness probe answers at once
        assert time.monotonic() - start < 2
        for path in ("/health", "/health_generate"):
            start = time.monotonic()
            status, _ = call(url, path, timeout=HEALTH_TIMEOUT_S + 10)
            waited = time.monotonic() - start
            assert status == 503 and HEALTH_TIMEOUT_S * 0.9 <= waited < HEALTH_TIMEOUT_S + 5, (path, status, waited)
        with ThreadPoolExecutor(1) as ex:
            probe = ex.submit(call, url, "/health", timeout=HEALTH_TIMEOUT_S + 10)
            time.sleep(HEALTH_TIMEOUT_S / 4)
            assert not probe.done()
            assert call(url, "/continue_generation", {})[0] == 200
            assert probe.result(timeout=HEALTH_TIMEOUT_S + 10)[0] == 200  # answered once generation resumed
    finally:
        call(url, "/continue_generation", {})
    assert call(url, "/ready")[0] == 200 and call(url, "/health")[0] == 200


# ---- /update_weights_from_disk with broken files ---------------------------------------------
def _corrupt_file(folder: Path) -> str:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-tensor
    return "model.safetensors"


def _garbage_header(folder: Path) -> str:
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    return "model.safetensors"


def _bad_index_json(folder: Path) -> str:
    (folder / "model.safetensors.index.json").write_text("{not json")
    return "model.safetensors.index.json"


def _index_without_map(folder: Path) -> str:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    return "model.safetensors.index.json"


def _index_to_missing_shard(folder: Path) -> str:
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    return "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("breaker", [_corrupt_file, _garbage_header, _bad_index_json, _index_without_map,
                                     _index_to_missing_shard])
def test_disk_update_from_broken_files_is_400_naming_the_file(server, models, tmp_path: Path, breaker) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(models[1], folder)
    named = breaker(folder)
    before = checksums(server.url)
    status, reply = call(server.url, "/update_weights_from_disk",
                         {"model_path": str(folder), "weight_version": "broken"}, timeout=QUICK_S)
    assert status == 400 and reply["success"] is False and named in reply["message"], (status, reply)
    assert checksums(server.url) == before and version(server.url) == "v0"
    status, _ = call(server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
