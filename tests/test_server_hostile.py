"""Requests that once froze or exhausted the embedded server, and states in which /health did not tell the truth.

Each probe is the attacker's input sent over real sockets to a real server process on 127.0.0.1:
an 8 MB prompt, a long ``rid`` fanned out by ``n``, half-sent headers, a weights file that never
delivers (a FIFO), a non-UTF-8 key, pause and continue racing, non-finite weights. After each, the
server must still answer and generate.
"""
from __future__ import annotations

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

from megatron_areal.launch.embedded import start_embedded
from megatron_areal.model.assets import make_tiny_model
from megatron_areal.server.weights import read_safetensors
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.wire import WeightUpdateGroup

KEY = "hostile-key"
HEADER_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 3.0
LOAD_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 2.0
# The server's flags for this module; each bound is small so that the probes finish quickly.
SERVER_ARGS = ["--api-key", KEY, "--health-timeout", "1", "--weight-load-timeout", str(LOAD_TIMEOUT_S),
               "--header-timeout", str(HEADER_TIMEOUT_S), "--idle-timeout", str(IDLE_TIMEOUT_S),
               "--body-timeout", str(BODY_TIMEOUT_S),
               "--weight-group-timeout", "30"]


def call(url: str, path: str, body: Any = None, *, key: str | None = KEY, timeout: float = 30.0) -> tuple[Any, Any]:
    """(status, reply), or (None, why) when no reply came in time."""
    try:
        return http_call(url, path, body, key=key, timeout=timeout)
    except (OSError, TimeoutError) as e:
        return None, f"{type(e).__name__}: {e}"


def generate_ok(url: str, timeout: float = 20.0) -> bool:
    status, reply = call(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                         timeout=timeout)
    return status == 200 and len(reply["output_ids"]) == 2


def checksums(url: str) -> dict[str, str]:
    return {k: v["sha256"] for k, v in call(url, "/weights_checksum")[1]["checksums"].items()}


def message(reply: Any) -> str:
    if isinstance(reply, dict):
        return str(reply.get("message") or reply.get("error", {}).get("message"))
    return str(reply)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hostile") / "m", "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model: Path):
    srv = start_embedded(model, args=SERVER_ARGS)
    yield srv
    srv.stop()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


# ---- one request must not freeze or exhaust the server -------------------------------------------
def test_8mb_text_prompt_is_refused_before_tokenising_while_health_answers(server) -> None:
    before = rss_mb(server.proc.pid)
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(call, server.url, "/generate", {"text": "7 " * 4_000_000}, timeout=120)
        probes = []
        while not pending.done():
            t0 = time.monotonic()
            probes.append((call(server.url, "/health", timeout=5)[0], time.monotonic() - t0))
            time.sleep(0.1)
        status, reply = pending.result()
    assert status == 400 and "text" in message(reply) and "2048" in message(reply), reply
    assert all(s == 200 for s, _ in probes), f"/health during the request: {probes}"
    grown = rss_mb(server.proc.pid) - before
    assert grown < 200, f"the server kept {grown:.0f} MiB after refusing the prompt"
    assert generate_ok(server.url)


def test_long_text_is_tokenised_off_the_event_loop(model) -> None:
    """A long context admits a text that takes seconds to tokenise: /health answers meanwhile."""
    srv = start_embedded(model, args=["--context-length", "65536", "--max-running", "1"])
    try:
        with ThreadPoolExecutor(1) as ex:
            pending = ex.submit(call, srv.url, "/generate", {"text": "7 " * 300_000}, key=None, timeout=300)
            probes = []
            while not pending.done():
                probes.append(call(srv.url, "/health", key=None, timeout=3)[0])
                time.sleep(0.2)
            status, reply = pending.result()
        # 600,000 one-character tokens: refused after tokenising, for the context
        assert status == 400 and "65536" in message(reply), reply
        assert len(probes) >= 3 and all(p == 200 for p in probes), f"/health while tokenising: {probes}"
    finally:
        srv.stop()


def test_text_prompt_that_fits_still_works(server) -> None:
    status, reply = call(server.url, "/generate", {"text": "1 + 2 = " * 100, "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and reply["meta_info"]["prompt_tokens"] == 800, reply


@pytest.mark.parametrize("body,field", [
    pytest.param({"input_ids": [1, 2], "rid": "r" * 262_144, "sampling_params": {"n": 4, "max_new_tokens": 1}},
                 "rid", id="rid-256k"),
    pytest.param({"input_ids": [[1, 2], [3]], "rid": ["a", "b" * 100_000]}, "rid", id="rid-in-list"),
    pytest.param({"input_ids": [1, 2], "sampling_params": {"n": 1000, "max_new_tokens": 2000, "ignore_eos": True}},
                 "max_new_tokens", id="n-1000-x-2000-tokens"),
    pytest.param({"input_ids": [1, 2], "sampling_params": {"stop": ["s" * 1_000_000], "max_new_tokens": 1}},
                 "stop", id="stop-string-1m"),
])
def test_what_a_request_may_cost_is_bounded(server, body, field) -> None:
    status, reply = call(server.url, "/generate", body, timeout=10)
    assert status == 400 and field in message(reply), reply
    assert generate_ok(server.url)


# ---- connections: half-sent headers, idle keep-alive, refusing without a key ---------------------
def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (reading and dropping whatever it sends)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset
            return True
    return False


def test_half_sent_headers_time_out_and_do_not_starve_health(server) -> None:
    server_proc = psutil.Process(server.proc.pid)
    limit = server_proc.rlimit(psutil.RLIMIT_NOFILE)
    server_proc.rlimit(psutil.RLIMIT_NOFILE, (256, limit[1]))  # the tester's file limit
    socks: list[socket.socket] = []
    try:
        for _ in range(300):
            s = _raw(server.url)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
        status, why = call(server.url, "/health", timeout=10)
        assert status == 200, f"/health with 300 half-open connections: {why}"
        assert generate_ok(server.url, timeout=10)
        still_open = [s for s in socks if not _closed_by_server(s, HEADER_TIMEOUT_S + 5)]
        assert not still_open, f"{len(still_open)} of 300 connections with half-sent headers still open"
    finally:
        for s in socks:
            s.close()
        server_proc.rlimit(psutil.RLIMIT_NOFILE, limit)


def test_idle_keep_alive_connection_is_closed(server) -> None:
    with _raw(server.url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request, never finished
        assert _closed_by_server(s, IDLE_TIMEOUT_S + 5)


def test_body_sent_too_slowly_gets_408(server) -> None:
    with _raw(server.url) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"input_ids\"")
        s.settimeout(BODY_TIMEOUT_S + 10)
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert generate_ok(server.url)


def test_unauthenticated_request_is_refused_without_reading_its_body(server) -> None:
    with _raw(server.url) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{")
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 401"), head
        assert b"connection: close" in head.lower(), head
        assert _closed_by_server(s, 5.0), "the server kept reading the body of a request it refused"
    assert generate_ok(server.url)


def test_non_utf8_authorization_is_401(server) -> None:
    with _raw(server.url) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head


# ---- a weight load that never finishes ---------------------------------------------------------
def _unblock_fifo(path: Path) -> None:
    """Open and close the FIFO's writing end, so a reader stuck on it gets end-of-file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader is waiting (any more)
        pass


def test_weight_load_from_a_fifo_neither_freezes_endpoints_nor_replaces_weights(server, model, tmp_path) -> None:
    folder = tmp_path / "fifo-model"
    folder.mkdir()
    shutil.copy(model / "config.json", folder / "config.json")
    fifo = folder / "model.safetensors"
    os.mkfifo(fifo)
    before = checksums(server.url)
    try:
        with ThreadPoolExecutor(1) as ex:
            pending = ex.submit(call, server.url, "/update_weights_from_disk",
                               {"model_path": str(folder), "weight_version": "fifo"}, timeout=60)
            time.sleep(0.5)  # the load is waiting on the FIFO now
            for path in ("/pause_generation", "/continue_generation"):
                status, why = call(server.url, path, {}, timeout=5)
                assert status == 200, f"{path} during a blocked load: {why}"
            assert call(server.url, "/health", timeout=5)[0] == 200
            assert generate_ok(server.url, timeout=10)
            status, reply = pending.result(timeout=60)
        assert status == 400 and "model.safetensors" in message(reply), reply
        assert "not a regular file" in message(reply), reply  # refused before it is opened for reading
        assert checksums(server.url) == before
        assert call(server.url, "/model_info")[1]["weight_version"] != "fifo"
        assert generate_ok(server.url)
    finally:
        _unblock_fifo(fifo)


# ---- /health tells the truth ------------------------------------------------------------------
def _send_together(barrier: threading.Barrier, url: str, path: str) -> None:
    barrier.wait()
    call(url, path, {"mode": "abort"} if path == "/pause_generation" else {}, timeout=10)


def test_racing_pause_and_continue_leave_health_and_generation_consistent(server) -> None:
    violations = []
    for attempt in range(20):
        barrier = threading.Barrier(2)
        order = ["/pause_generation", "/continue_generation"][:: 1 if attempt % 2 else -1]
        threads = [threading.Thread(target=_send_together, args=(barrier, server.url, p)) for p in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        health = call(server.url, "/health", timeout=5)[0]
        if health == 200 and not generate_ok(server.url, timeout=20):
            violations.append(attempt)
        assert call(server.url, "/continue_generation", {}, timeout=10)[0] == 200
        status, reply = call(server.url, "/generate",
                             {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert status == 200 and len(reply["output_ids"]) == 2, f"attempt {attempt}: after continue: {reply}"
    assert not violations, f"/health said 200 while /generate hung after attempts {violations}"


def _model_with(model: Path, out: Path, value: float) -> tuple[Path, str]:
    """A copy of ``model`` with one element of one tensor set to ``value``; returns (folder, tensor name)."""
    out.mkdir()
    shutil.copy(model / "config.json", out / "config.json")
    tensors = read_safetensors(model)
    name = sorted(n for n in tensors if n.endswith("mlp.down_proj.weight"))[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] = value
    save_file(tensors, str(out / "model.safetensors"))
    return out, name


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_from_disk_are_refused(server, model, tmp_path, value) -> None:
    folder, name = _model_with(model, tmp_path / "bad", value)
    before = checksums(server.url)
    status, reply = call(server.url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "bad"})
    assert status == 400 and name in message(reply) and "finite" in message(reply), reply
    assert checksums(server.url) == before
    assert call(server.url, "/health")[0] == 200
    status, reply = call(server.url, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and all(isinstance(lp, float) for lp, _, _ in reply["meta_info"]["output_token_logprobs"])


def broadcast_bucket(url: str, group_name: str, name: str, tensor: torch.Tensor,
                     key: str | None = KEY) -> tuple[Any, Any]:
    """Joins a weight group with the server as the trainer does, broadcasts ``tensor`` as the bucket of
    ``name`` and returns the server's (status, reply) to that update; the group is left afterwards."""
    port = free_port()
    with ThreadPoolExecutor(1) as ex:
        trainer = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                            world_size=2, group_name=group_name, backend="gloo", timeout_s=30)
        status, reply = call(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"}, key=key)
        group = trainer.result(timeout=60)
    assert status == 200, reply
    try:
        assert call(url, "/begin_weight_update", {"selector": "all"}, key=key)[0] == 200
        with ThreadPoolExecutor(1) as ex:
            pending = ex.submit(call, url, "/update_weights_from_distributed", {
                "names": [name], "dtypes": [str(tensor.dtype).removeprefix("torch.")],
                "shapes": [list(tensor.shape)], "group_name": group_name, "weight_version": group_name},
                key=key, timeout=60)
            time.sleep(0.5)
            group.broadcast(tensor)
            answer = pending.result(timeout=60)
        assert call(url, "/end_weight_update", {}, key=key)[0] == 200
        return answer
    finally:
        call(url, "/destroy_weights_update_group", {"group_name": group_name}, key=key)
        group.destroy()


def test_non_finite_bucket_from_the_trainer_is_refused(server, model) -> None:
    tensors = read_safetensors(model)
    name = sorted(n for n in tensors if n.endswith("self_attn.o_proj.weight"))[0]
    bad = tensors[name].clone()
    bad.view(-1)[3] = float("nan")
    before = checksums(server.url)
    status, reply = broadcast_bucket(server.url, "nan", name, bad)
    assert status == 400 and name in message(reply) and "finite" in message(reply), reply
    assert checksums(server.url) == before
    assert call(server.url, "/health")[0] == 200 and generate_ok(server.url)


