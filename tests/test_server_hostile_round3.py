"""Keyless clients, device files as weights, long version strings and big bodies, against a real server.

Each probe is an attacker's input over real sockets to a real ``megatron-areal serve`` process on
127.0.0.1 that has an API key and a small ``--max-connections``: keyless connections held open
while the server is paused, ``model.safetensors`` pointing at ``/dev/zero`` or a huge sparse file,
an 8 MB weight version, eight 15 MB ``input_ids`` bodies at once, integer tensors as weights.
After each, the trainer's keyed routes must still answer.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from netutil import http_call
from safetensors.torch import save_file
from test_server_hostile import broadcast_bucket

from megatron_areal.launch.embedded import start_embedded
from megatron_areal.model.assets import make_tiny_model
from megatron_areal.server.weights import read_safetensors

KEY = "round3-key"
MAX_CONNECTIONS = 16
HEALTH_TIMEOUT_S = 10.0  # SGLang's is 20 s; a keyed /health while paused waits this long
CLIENT_HEALTH_TIMEOUT_S = 5.0  # the rollout client's /health timeout (rollout/client.py)
LOAD_TIMEOUT_S = 3.0
SERVER_ARGS = ["--api-key", KEY, "--max-connections", str(MAX_CONNECTIONS),
               "--health-timeout", str(HEALTH_TIMEOUT_S), "--weight-load-timeout", str(LOAD_TIMEOUT_S),
               "--header-timeout", "20", "--idle-timeout", "30", "--weight-group-timeout", "30"]


def call(url: str, path: str, body: Any = None, *, key: str | None = KEY, timeout: float = 30.0,
         raw: bytes | None = None) -> tuple[Any, Any]:
    """(status, reply), or (None, why) when no reply came in time or the connection was reset."""
    try:
        return http_call(url, path, body, key=key, timeout=timeout, raw=raw)
    except (OSError, TimeoutError) as e:
        return None, f"{type(e).__name__}: {e}"


def message(reply: Any) -> str:
    if isinstance(reply, dict):
        return str(reply.get("message") or reply.get("error", {}).get("message"))
    return str(reply)


def generate_ok(url: str, timeout: float = 20.0) -> bool:
    status, reply = call(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                         timeout=timeout)
    return status == 200 and len(reply["output_ids"]) == 2


def checksums(url: str) -> dict[str, str]:
    return {k: v["sha256"] for k, v in call(url, "/weights_checksum")[1]["checksums"].items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("round3") / "m", "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model: Path):
    srv = start_embedded(model, args=SERVER_ARGS)
    yield srv
    srv.stop()


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the server closed it already (it was over the limit)
        pass


def _read_reply(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One HTTP reply (head and a Content-Length body) from ``sock``; b"" when the server closed it."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body
    except OSError:  # reset
        return data


def _keyless_flood(url: str) -> list[socket.socket]:
    """More keyless connections than the connection limit, each holding on in its own way: a complete
    ``GET /health`` whose reply is never read (first, so that these alone would fill every slot), then
    half-sent headers, then open-route requests whose bodies never finish."""
    socks = []
    for _ in range(MAX_CONNECTIONS + 4):
        socks.append(_raw(url))
        _send(socks[-1], b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)  # each is being handled now
    for i in range(MAX_CONNECTIONS):
        socks.append(_raw(url))
        _send(socks[-1], b"GET /health_generate HTTP/1.1\r\nHost: x\r\nX-Slow: " if i % 2 else
              b"GET /ready HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{\"a\": ")
    return socks


# ---- keyless clients cannot take the slots the trainer needs -------------------------------------
def test_keyless_connections_cannot_lock_the_trainer_out_of_a_paused_server(server) -> None:
    assert call(server.url, "/pause_generation", {"mode": "abort"})[0] == 200
    socks: list[socket.socket] = []
    try:
        socks = _keyless_flood(server.url)
        time.sleep(0.5)  # every flood connection has been accepted and its request (if whole) dispatched
        status, reply = call(server.url, "/v1/loads", timeout=5)
        assert status == 200, f"keyed /v1/loads with {len(socks)} keyless connections held: {reply}"
        status, reply = call(server.url, "/continue_generation", {}, timeout=5)
        assert status == 200, f"keyed /continue_generation with {len(socks)} keyless connections held: {reply}"
        assert generate_ok(server.url)
    finally:
        for s in socks:
            s.close()
        call(server.url, "/continue_generation", {})


def test_the_trainers_idle_keep_alive_connection_survives_a_keyless_flood(server) -> None:
    keyed = _raw(server.url)
    request = b"GET /v1/loads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    socks: list[socket.socket] = []
    try:
        keyed.sendall(request)
        assert _read_reply(keyed).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)  # idle now, and the oldest connection of all
        socks = _keyless_flood(server.url)
        time.sleep(0.5)
        keyed.sendall(request)
        reply = _read_reply(keyed)
        assert reply.startswith(b"HTTP/1.1 200"), f"the trainer's connection after the flood: {reply[:200]!r}"
    finally:
        keyed.close()
        for s in socks:
            s.close()


def test_a_new_connection_replaces_keyless_requests_before_keyed_ones() -> None:
    """The guard alone, over real sockets, with requests marked as the API's middleware marks them: at the
    limit, a connection busy with a keyless request makes room; one busy with a keyed request never does."""
    import asyncio

    from megatron_areal.server.connections import ConnectionGuard, ConnectionLimits

    async def scenario() -> None:
        guard, seen = ConnectionGuard(ConnectionLimits(max_connections=3)), []

        class Seen(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                seen.append(transport)

        listener = await asyncio.get_running_loop().create_server(guard.factory(Seen), "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        writers = []

        async def connect(n: int) -> None:
            writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
            while len(seen) < n:
                await asyncio.sleep(0.01)

        try:
            for n in (1, 2, 3):
                await connect(n)
            guard.started(seen[0], keyed=True)
            guard.started(seen[1], keyed=False)
            guard.started(seen[2], keyed=True)
            await connect(4)
            assert [t.is_closing() for t in seen] == [False, True, False, False]
            guard.started(seen[3], keyed=True)
            await connect(5)  # every connection is handling a keyed request: the new one is refused
            assert [t.is_closing() for t in seen] == [False, True, False, False, True]
        finally:
            for w in writers:
                w.close()
            guard.close()
            listener.close()

    asyncio.run(scenario())


def test_health_tells_a_keyless_client_nothing_about_a_pause(server) -> None:
    """Answered at once and the same as when generating; the trainer's keyed probe keeps SGLang's wait."""
    unpaused = {p: call(server.url, p, key=None, timeout=5) for p in ("/health", "/health_generate", "/ready")}
    assert all(status == 200 for status, _ in unpaused.values()), unpaused
    assert call(server.url, "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        for path, before in unpaused.items():
            start = time.monotonic()
            during = call(server.url, path, key=None, timeout=CLIENT_HEALTH_TIMEOUT_S)
            assert during == before, f"keyless {path} while paused: {during}, generating: {before}"
            assert time.monotonic() - start < CLIENT_HEALTH_TIMEOUT_S
        assert call(server.url, "/ready", timeout=5)[0] == 503  # the key holder still sees the pause
        with ThreadPoolExecutor(1) as ex:
            keyed = ex.submit(call, server.url, "/health", timeout=HEALTH_TIMEOUT_S + 10)
            time.sleep(1.0)
            assert not keyed.done(), "a keyed /health while paused waits, as SGLang's does"
            assert call(server.url, "/continue_generation", {})[0] == 200
            assert keyed.result(timeout=HEALTH_TIMEOUT_S + 10)[0] == 200
    finally:
        call(server.url, "/continue_generation", {})


# ---- weights from a device file or a sparse file ----------------------------------------------
def _folder_with(model: Path, folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(model / "config.json", folder / "config.json")
    return folder / "model.safetensors"


def _load_watching_memory(srv, folder: Path, limit_mb: float) -> tuple[Any, Any, float, float]:
    """POST the load and watch the server's memory: (status, reply, seconds to reply, MiB grown at most).
    A server that grows past ``limit_mb`` is killed (this machine has other work), and the load counts as
    unanswered."""
    proc = psutil.Process(srv.proc.pid)
    before = proc.memory_info().rss / 2**20
    grown = 0.0
    with ThreadPoolExecutor(1) as ex:
        start = time.monotonic()
        pending = ex.submit(call, srv.url, "/update_weights_from_disk",
                            {"model_path": str(folder), "weight_version": "device"}, timeout=60)
        while not pending.done():
            grown = max(grown, proc.memory_info().rss / 2**20 - before)
            if grown > limit_mb:
                proc.kill()
                break
            time.sleep(0.05)
        status, reply = pending.result(timeout=60)
        took = time.monotonic() - start
    deadline = time.monotonic() + 2 * LOAD_TIMEOUT_S  # a reader still running after the reply would grow on
    while proc.is_running() and time.monotonic() < deadline:
        try:
            grown = max(grown, proc.memory_info().rss / 2**20 - before)
        except psutil.NoSuchProcess:
            break
        if grown > limit_mb:
            proc.kill()
            break
        time.sleep(0.05)
    return status, reply, took, grown


@pytest.mark.parametrize("source", ["dev-zero", "sparse-8gib", "sparse-1tib"])
def test_weights_from_a_device_or_sparse_file_are_refused_without_reading_them(model, tmp_path, source) -> None:
    target = _folder_with(model, tmp_path / "evil")
    if source == "dev-zero":
        target.symlink_to("/dev/zero")
    else:
        with open(target, "wb") as f:
            f.truncate(2**33 if source == "sparse-8gib" else 2**40)  # no block on disk
    srv = start_embedded(model, args=SERVER_ARGS)
    try:
        before = checksums(srv.url)
        threads = psutil.Process(srv.proc.pid).num_threads()
        status, reply, took, grown = _load_watching_memory(srv, target.parent, limit_mb=500)
        assert grown < 100, f"the server grew by {grown:.0f} MiB reading {source} (killed past 500)"
        assert status == 400 and "model.safetensors" in message(reply), reply
        assert took < LOAD_TIMEOUT_S, f"refused after {took:.1f}s: the size is known before reading"
        assert psutil.Process(srv.proc.pid).num_threads() <= threads, "a reader thread outlived the reply"
        assert checksums(srv.url) == before and generate_ok(srv.url)
    finally:
        srv.stop()


def test_a_reader_fed_without_end_stops_at_the_timeout(tmp_path) -> None:
    """A source that keeps delivering (a pipe here; a device or a stuck filesystem in the field): the load
    fails at its timeout, the reply states that timeout, and no reading goes on afterwards."""
    from megatron_areal.server.weights import WeightError, read_fd_bounded

    read_end, write_end = os.pipe()
    stop = threading.Event()

    def feed() -> None:
        chunk = b"\0" * 2**16
        try:
            while not stop.is_set():
                os.write(write_end, chunk)
                time.sleep(0.001)
        except OSError:  # the reader closed its end
            pass

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    before = threading.active_count()
    try:
        start = time.monotonic()
        with pytest.raises(WeightError, match=r"within the weight-load timeout of 1\.5s") as caught:
            read_fd_bounded(read_end, "pipe", max_bytes=2**40, timeout_s=1.5)
        took = time.monotonic() - start
        assert 1.5 <= took < 5, took
        assert "pipe" in str(caught.value)
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() == before, "the reader thread outlived the timeout"
    finally:
        stop.set()
        for fd in (read_end, write_end):
            try:
                os.close(fd)
            except OSError:
                pass


# ---- every field a client controls is bounded in what it costs ---------------------------------
BIG = "v" * 8_000_000


@pytest.mark.parametrize("path,body,field", [
    pytest.param("/update_weight_version", {"new_version": BIG, "abort_all_requests": False}, "new_version",
                 id="update_weight_version"),
    pytest.param("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": BIG},
                 "weight_version", id="disk-version"),
    pytest.param("/update_weights_from_disk", {"model_path": "/" + "p" * 1_000_000}, "model_path",
                 id="disk-path"),
    pytest.param("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                      "weight_version": BIG}, "weight_version",
                 id="distributed-version"),
    pytest.param("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                "world_size": 2, "group_name": "g" * 1_000_000}, "group_name",
                 id="group-name"),
    pytest.param("/update_weights_from_distributed", {"names": ["n" * 2000], "dtypes": ["float32"], "shapes": [[1]]},
                 "names", id="tensor-name"),
    pytest.param("/abort_request", {"rid": "r" * 1_000_000}, "rid", id="abort-rid"),
    pytest.param("/pause_generation", {"mode": "m" * 8_000_000}, "mode", id="any-string-field"),
])
def test_client_strings_are_bounded(server, path, body, field) -> None:
    status, reply = call(server.url, path, body)
    assert status == 400 and field in message(reply), (status, message(reply)[:300])
    assert len(json.dumps(reply)) < 10_000, f"the 400 echoes {len(json.dumps(reply))} bytes"
    assert call(server.url, "/model_info")[1]["weight_version"] != BIG


@pytest.mark.parametrize("body", [
    pytest.param({"input_ids": [1], "k" * 8_000_000: 1}, id="unknown-key"),
    pytest.param({"input_ids": [1], "sampling_params": {"k" * 8_000_000: 1}}, id="unknown-sampling-key"),
])
def test_an_error_reply_does_not_echo_a_long_value(server, body) -> None:
    status, reply = call(server.url, "/generate", body)
    assert status == 400 and "unknown field" in message(reply), message(reply)[:300]
    assert len(json.dumps(reply)) < 10_000, f"the 400 echoes {len(json.dumps(reply))} bytes"


def test_a_long_version_cannot_multiply_into_a_huge_reply(server) -> None:
    version = "v" * 256  # the longest a version may be
    assert call(server.url, "/update_weight_version", {"new_version": version, "abort_all_requests": False})[0] == 200
    try:
        status, reply = call(server.url, "/generate", {"input_ids": [1, 2, 3],
                                                       "sampling_params": {"n": 16, "max_new_tokens": 2}})
        assert status == 200 and len(reply) == 16 and reply[0]["meta_info"]["weight_version"] == version
        assert len(json.dumps(reply)) < 100_000
    finally:
        call(server.url, "/update_weight_version", {"new_version": "default", "abort_all_requests": False})


# ---- big bodies are parsed off the event loop --------------------------------------------------
@pytest.mark.parametrize("shape,refusal", [
    pytest.param({"input_ids": [7] * 5_000_000, "sampling_params": {"max_new_tokens": 1}}, "context", id="input_ids"),
    pytest.param({"input_ids": [[]] * 3_700_000}, "values", id="empty-rows"),
])
def test_big_bodies_do_not_stall_health(server, shape, refusal) -> None:
    body = json.dumps(shape).encode()
    assert 14e6 < len(body) < 16 * 2**20
    with ThreadPoolExecutor(8) as ex:
        pending = [ex.submit(call, server.url, "/generate", raw=body, timeout=300) for _ in range(8)]
        probes = []
        while not all(p.done() for p in pending):
            start = time.monotonic()
            status, why = call(server.url, "/health", key=None, timeout=CLIENT_HEALTH_TIMEOUT_S)
            probes.append((status, round(time.monotonic() - start, 2), why if status != 200 else ""))
            time.sleep(0.2)
        replies = [p.result() for p in pending]
    failed = [p for p in probes if p[0] != 200]
    assert probes and not failed, f"/health within the client's {CLIENT_HEALTH_TIMEOUT_S:.0f}s while 8 bodies " \
                                  f"were parsed: {failed} of {len(probes)} probes failed"
    assert all(status == 400 and refusal in message(reply) for status, reply in replies), \
        [(s, message(r)[:200]) for s, r in replies]
    assert generate_ok(server.url)


# ---- only floating-point tensors are weights ---------------------------------------------------
def _model_with_dtype(model: Path, out: Path, dtype: torch.dtype) -> tuple[Path, str]:
    out.mkdir()
    shutil.copy(model / "config.json", out / "config.json")
    tensors = read_safetensors(model)
    name = sorted(n for n in tensors if n.endswith("mlp.up_proj.weight"))[0]
    tensors[name] = (tensors[name] * 4).to(dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out, name


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=["int64", "bool"])
def test_non_float_weights_from_disk_are_refused(server, model, tmp_path, dtype) -> None:
    folder, name = _model_with_dtype(model, tmp_path / "ints", dtype)
    before = checksums(server.url)
    status, reply = call(server.url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "i"})
    assert status == 400 and name in message(reply) and str(dtype).removeprefix("torch.") in message(reply), reply
    assert checksums(server.url) == before
    assert call(server.url, "/model_info")[1]["weight_version"] != "i"


def test_non_float_bucket_from_the_trainer_is_refused(server, model) -> None:
    tensors = read_safetensors(model)
    name = sorted(n for n in tensors if n.endswith("self_attn.q_proj.weight"))[0]
    bad = (tensors[name] * 4).to(torch.int64)
    before = checksums(server.url)
    status, reply = broadcast_bucket(server.url, "ints", name, bad, key=KEY)
    assert status == 400 and name in message(reply) and "int64" in message(reply), reply
    assert checksums(server.url) == before


