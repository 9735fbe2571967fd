"""The embedded server as a real process on localhost, checked against transformers."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from netutil import http_call, paused

from megatron_areal.launch.embedded import start_embedded
from megatron_areal.model.assets import make_tiny_model
from megatron_areal.server.weights import read_safetensors, tensor_checksum
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.wire import WeightUpdateGroup

KEY = "secret-key"


def call(url: str, path: str, body: Any = None, *, key: str | None = KEY, timeout: float = 120,
         **kw: Any) -> tuple[int, Any]:
    return http_call(url, path, body, key=key, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    a = make_tiny_model(root / "a", "llama", seed=0, max_position_embeddings=4096)
    b = make_tiny_model(root / "b", "llama", seed=1, max_position_embeddings=4096)
    return a, b


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    reg = tmp_path_factory.mktemp("servers")
    srv = start_embedded(models[0], args=["--api-key", KEY, "--max-running", "16", "--context-length", "4096",
                                          "--max-body-mb", "1", "--register-dir", str(reg), "--server-id", "s0",
                                          "--weight-version", "v0"])
    srv.register_dir = reg
    yield srv
    srv.stop()
    assert not (reg / "s0").exists(), "registration must be removed on shutdown"


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teacher_forced(model, ids: list[int], n_out: int, temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    start = len(ids) - n_out
    return [lp[start - 1 + k, ids[start + k]].item() for k in range(n_out)]


def load(url: str, path: Path, version: str) -> None:
    status, reply = call(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version})
    assert status == 200 and reply["success"], reply


PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [10, 20, 30, 40, 50, 60, 70, 80]]


def test_registration_file(server) -> None:
    info = json.loads((server.register_dir / "s0").read_text())
    assert info["url"] == server.url and info["pid"] == server.proc.pid


def test_greedy_batch_matches_transformers(server, models) -> None:
    load(server.url, models[0], "v0")
    hf = hf_model(models[0])
    body = {"input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    status, out = call(server.url, "/generate", body)
    assert status == 200 and len(out) == len(PROMPTS)
    for ids, res in zip(PROMPTS, out, strict=True):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        assert res["output_ids"] == ref
        meta = res["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 24
        assert meta["weight_version"] == "v0"
        got = [e[0] for e in meta["output_token_logprobs"]]
        assert [e[1] for e in meta["output_token_logprobs"]] == ref
        assert max(abs(a - b) for a, b in zip(got, teacher_forced(hf, ids + ref, 24), strict=True)) <= 1e-4


def test_sampled_logprobs_use_temperature_and_n_ordering(server, models) -> None:
    load(server.url, models[0], "v0")
    hf = hf_model(models[0])
    body = {"input_ids": PROMPTS[:2], "return_logprob": True, "rid": "samp",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.7, "n": 3, "ignore_eos": True,
                                "top_p": 0.9, "top_k": 20}}
    status, out = call(server.url, "/generate", body)
    assert status == 200 and len(out) == 6
    for i, res in enumerate(out):
        ids = PROMPTS[i // 3]
        assert res["meta_info"]["id"] == f"samp_{i // 3}_{i % 3}"
        got = [e[0] for e in res["meta_info"]["output_token_logprobs"]]
        ref = teacher_forced(hf, ids + res["output_ids"], 16, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-4


def test_seed_reproducible_and_stop_tokens(server) -> None:
    sp = {"max_new_tokens": 32, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    first = call(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp})[1]
    again = call(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp})[1]
    assert first["output_ids"] == again["output_ids"]
    stop = first["output_ids"][5]
    k = first["output_ids"].index(stop)
    sp_stop = {**sp, "stop_token_ids": [stop]}
    res = call(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp_stop})[1]
    assert res["output_ids"] == first["output_ids"][: k + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_text_prompt_through_tokenizer(server) -> None:
    status, res = call(server.url, "/generate", {"text": "1 + 2 =", "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and isinstance(res["text"], str) and res["meta_info"]["prompt_tokens"] > 0


@pytest.mark.parametrize("body,raw,expect", [
    (None, b"{not json", 400),
    ({"input_ids": "abc"}, None, 400),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, None, 400),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, None, 400),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, None, 400),
    ({"input_ids": [1, 10**6]}, None, 400),
    ({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}}, None, 400),
    ({"input_ids": [[1, 2], []]}, None, 400),
    ({"input_ids": [1, 2], "text": "x"}, None, 400),
    (None, b'{"input_ids": [' + b"1," * 600_000 + b"1]}", 413),
])
def test_bad_input_gets_4xx_then_server_still_serves(server, body, raw, expect) -> None:
    status, reply = call(server.url, "/generate", body, raw=raw)
    assert status == expect, reply
    if expect == 400:
        assert reply["error"]["message"]
    ok, res = call(server.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert ok == 200 and len(res["output_ids"]) >= 1


def test_auth_required_except_health(server) -> None:
    for path, body in [("/generate", {"input_ids": [1]}), ("/pause_generation", {}), ("/flush_cache", {}),
                       ("/abort_request", {"abort_all": True}), ("/update_weights_from_disk", {"model_path": "x"})]:
        assert call(server.url, path, body, key=None)[0] == 401
        assert call(server.url, path, body, key="wrong")[0] == 401
    assert call(server.url, "/health", key=None)[0] == 200


def test_info_endpoints(server) -> None:
    assert call(server.url, "/get_weight_version")[1]["weight_version"] == "v0"
    info = call(server.url, "/model_info")[1]
    assert info["weight_version"] == "v0" and info["architectures"] == ["LlamaForCausalLM"]
    loads = call(server.url, "/v1/loads")[1]["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0
    assert call(server.url, "/flush_cache", {})[0] == 200


def _wait_running(url: str, n: int = 1, field: str = "num_running_reqs") -> None:
    deadline = time.monotonic() + 30
    while call(url, "/v1/loads")[1]["loads"][0][field] < n:
        assert time.monotonic() < deadline, f"{field} never reached {n}"
        time.sleep(0.02)


def test_pause_returns_partial_then_resume_under_new_weights(server, models) -> None:
    load(server.url, models[0], "v0")
    prompt, max_new = PROMPTS[0], 3000
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(call, server.url, "/generate", body)
        _wait_running(server.url)
        assert call(server.url, "/pause_generation", {"mode": "abort"})[0] == 200
        status, part = pending.result(timeout=60)
    assert status == 200 and part["meta_info"]["finish_reason"]["type"] == "abort"
    partial = part["output_ids"]
    assert 1 <= len(partial) < max_new
    assert len(part["meta_info"]["output_token_logprobs"]) == len(partial)
    # While paused, new requests wait; the update itself runs at once.
    with ThreadPoolExecutor(1) as ex:
        waiting = ex.submit(call, server.url, "/generate", {
            "input_ids": prompt + partial, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}})
        time.sleep(0.5)
        assert not waiting.done()
        load(server.url, models[1], "v1")
        assert call(server.url, "/continue_generation", {})[0] == 200
        status, rest = waiting.result(timeout=60)
    assert status == 200 and rest["meta_info"]["weight_version"] == "v1"
    assert rest["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 20}]
    hf_b = hf_model(models[1])
    full = prompt + partial + rest["output_ids"]
    ref_ids = hf_b.generate(torch.tensor([prompt + partial]), max_new_tokens=20, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt + partial):].tolist()
    assert rest["output_ids"] == ref_ids
    got = [e[0] for e in rest["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, teacher_forced(hf_b, full, 20), strict=True)) <= 1e-4


def test_abort_request_by_rid(server) -> None:
    body = {"input_ids": PROMPTS[1], "rid": "long-one",
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(call, server.url, "/generate", body)
        _wait_running(server.url)
        assert call(server.url, "/generate", {**body, "sampling_params": {"max_new_tokens": 1}})[0] == 400
        assert call(server.url, "/abort_request", {"rid": "long-one"})[0] == 200
        status, res = pending.result(timeout=60)
    assert res["meta_info"]["finish_reason"]["type"] == "abort" and len(res["output_ids"]) < 3000


def test_200_concurrent_requests_complete(server) -> None:
    from megatron_areal.fleet.client import RolloutClient

    async def burst():
        async with RolloutClient(server.url, api_key=KEY, timeout_s=300) as client:
            sp = {"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True}
            return await asyncio.gather(*(client.generate([1, 2, i % 100 + 3], sp) for i in range(200)))

    results = asyncio.run(burst())
    assert len(results) == 200 and all(len(r.output_ids) == 8 and r.finish_reason == "length" for r in results)


def test_queue_full_answers_503(models) -> None:
    # 30,000 tokens: the first request should still be decoding when the second is seen waiting. On a
    # loaded machine the polls can be slow enough for it to finish first (the second then runs and the
    # queue is empty): then the scenario is set up again, and what each try saw is in the message.
    with start_embedded(models[0], args=["--max-running", "1", "--max-queue", "1", "--context-length", "32768"]) as srv:
        long = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 30000, "ignore_eos": True}}
        tries = []
        for _ in range(3):
            with ThreadPoolExecutor(3) as ex:
                first = ex.submit(call, srv.url, "/generate", long, key=None)
                _wait_running(srv.url)
                queued = ex.submit(call, srv.url, "/generate", long, key=None)
                _wait_running(srv.url, 1, field="num_waiting_reqs")
                with paused(srv.url):  # the first request keeps the only slot and does not decode
                    loads = call(srv.url, "/v1/loads")[1]["loads"][0]
                    full = loads["num_running_reqs"] == 1 and loads["num_waiting_reqs"] == 1
                    if full:
                        try:
                            status, reply = call(srv.url, "/generate", long, key=None, timeout=20)
                        except TimeoutError:  # queued (the engine does not step while paused)
                            status, reply = None, "no reply in 20 s"
                    tries.append(loads if not full else (status, reply, loads))
                assert call(srv.url, "/abort_request", {"abort_all": True}, key=None)[0] == 200
                assert first.result(60)[0] == 200 and queued.result(60)[0] == 200
            if full:
                break
        assert full, f"the queue was never full while paused: {tries}"
        assert status == 503 and "queue full" in reply["error"]["message"], tries
        ok = call(srv.url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}, key=None)
        assert ok[0] == 200


def _checksums(url: str) -> dict[str, str]:
    return {k: v["sha256"] for k, v in call(url, "/weights_checksum")[1]["checksums"].items()}


def test_distributed_update_over_gloo(server, models) -> None:
    load(server.url, models[0], "v0")
    port = free_port()
    with ThreadPoolExecutor(1) as ex:
        joining = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                            world_size=2, group_name="wug", backend="gloo", timeout_s=60)
        status, reply = call(server.url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "wug", "backend": "gloo"})
        group = joining.result(timeout=60)
    assert status == 200 and reply["success"], reply
    new = read_safetensors(models[1])
    names = sorted(new)

    def post(ex: ThreadPoolExecutor, tensors: dict[str, torch.Tensor], shapes: list[list[int]], flat: bool,
             version: str):
        """Announce a bucket and broadcast it, as the trainer does; the reply is awaited later."""
        meta = {"names": list(tensors), "dtypes": ["float32"] * len(tensors), "shapes": shapes,
                "group_name": "wug", "weight_version": version}
        if flat:
            meta["load_format"] = "flattened_bucket"
        reply = ex.submit(call, server.url, "/update_weights_from_distributed", meta)
        if flat:
            group.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]))
        else:
            for t in tensors.values():
                group.broadcast(t.clone())
        return reply

    def push(tensors: dict[str, torch.Tensor], shapes: list[list[int]], flat: bool, version: str):
        with ThreadPoolExecutor(1) as ex:
            return post(ex, tensors, shapes, flat, version).result(timeout=60)

    # SGLang 0.5.23 refuses distributed updates outside /begin_weight_update ... /end_weight_update
    assert call(server.url, "/begin_weight_update", {"selector": "all"})[0] == 200
    before = _checksums(server.url)
    bad = {names[0]: torch.zeros(3, 3)}
    status, reply = push(bad, [[3, 3]], False, "bad")
    assert status == 400 and not reply["success"] and "shape" in reply["message"]
    assert _checksums(server.url) == before and call(server.url, "/get_weight_version")[1]["weight_version"] == "v0"

    half = len(names) // 2
    first = {n: new[n] for n in names[:half]}
    second = {n: new[n] for n in names[half:]}
    with ThreadPoolExecutor(2) as ex:  # pipelined: bucket 2 is announced before bucket 1 is installed
        replies = [post(ex, first, [list(t.shape) for t in first.values()], False, "v1"),
                   post(ex, second, [list(t.shape) for t in second.values()], True, "v1")]
        assert [r.result(timeout=60)[0] for r in replies] == [200, 200]
    assert _checksums(server.url) == {n: tensor_checksum(new[n]) for n in names}
    assert call(server.url, "/get_weight_version")[1]["weight_version"] == "v1"
    assert call(server.url, "/end_weight_update", {})[0] == 200
    assert call(server.url, "/destroy_weights_update_group", {"group_name": "wug"})[0] == 200
    group.destroy()


def test_disk_update_refuses_wrong_model_and_keeps_weights(server, models, tmp_path: Path) -> None:
    load(server.url, models[0], "v0")
    before = _checksums(server.url)
    other = make_tiny_model(tmp_path / "wide", "llama", hidden_size=96)
    status, reply = call(server.url, "/update_weights_from_disk", {"model_path": str(other), "weight_version": "x"})
    assert status == 400 and "shape" in reply["message"]
    assert _checksums(server.url) == before
    assert call(server.url, "/get_weight_version")[1]["weight_version"] == "v0"


def test_concurrent_generation_survives_weight_update(server, models) -> None:
    """Requests running during an update are re-prefilled under the new weights and still finish."""
    load(server.url, models[0], "v0")
    n = 1500
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
    with ThreadPoolExecutor(4) as ex:
        pending = [ex.submit(call, server.url, "/generate", body) for _ in range(4)]
        _wait_running(server.url, 4)
        # held in place (not retracted) so that all four are mid-sequence when the update lands, however
        # fast the machine decodes
        with paused(server.url, key=KEY):
            load(server.url, models[1], "v1")
        results = [p.result(timeout=120) for p in pending]
    for status, res in results:
        assert status == 200 and len(res["output_ids"]) == n
        spans = res["meta_info"]["weight_versions"]
        assert spans[-1]["version"] == "v1" and spans[-1]["end"] == n


def test_retract_pause_resumes_same_request_under_new_weights(server, models) -> None:
    """mode=retract: the request keeps its connection, is re-prefilled after the update and finishes."""
    load(server.url, models[0], "v0")
    prompt, n = PROMPTS[1], 3500  # long enough to be running at the pause, even on a quiet machine
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(call, server.url, "/generate", body)
        _wait_running(server.url)
        with paused(server.url, "retract", key=KEY):
            time.sleep(0.2)
            assert not pending.done()
            load(server.url, models[1], "v1")
        status, res = pending.result(timeout=120)
    assert status == 200 and len(res["output_ids"]) == n
    spans = res["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["v0", "v1"] and spans[1]["end"] == n
    switch = spans[1]["start"]
    hf_a, hf_b = hf_model(models[0]), hf_model(models[1])
    full = prompt + res["output_ids"]
    got = [e[0] for e in res["meta_info"]["output_token_logprobs"]]
    head = teacher_forced(hf_a, full[: len(prompt) + switch], switch)
    tail = teacher_forced(hf_b, full[: len(prompt) + switch + 30], 30)  # the first tokens under v1
    assert max(abs(a - b) for a, b in zip(got[:switch], head, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(got[switch:switch + 30], tail, strict=True)) <= 1e-4


def test_client_disconnect_aborts_its_request(server) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with pytest.raises(TimeoutError):
        call(server.url, "/generate", body, timeout=1.0)
    deadline = time.monotonic() + 10
    while call(server.url, "/v1/loads")[1]["loads"][0]["num_running_reqs"]:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.1)


def test_stop_strings(server, models) -> None:
    from megatron_areal.server.tokenizer import load_tokenizer

    load(server.url, models[0], "v0")
    tok = load_tokenizer(models[0])
    sp = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}
    full = call(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp})[1]["output_ids"]
    stop = next(w for w in (tok.decode([t], skip_special_tokens=False).strip() for t in full[8:]) if w)
    end = next(j for j in range(len(full)) if stop in tok.decode(full[: j + 1], skip_special_tokens=False))
    status, res = call(server.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {**sp, "stop": stop}})
    assert status == 200 and res["output_ids"] == full[: end + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    text = tok.decode(full[: end + 1], skip_special_tokens=True)
    assert res["text"] == (text[: text.rindex(stop)] if stop in text else text)  # the stop string is trimmed
    assert call(server.url, "/generate", {"input_ids": [1], "sampling_params": {"stop": [1]}})[0] == 400
