"""The rollout client against a real embedded server, and its handling of SGLang version differences."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from megatron_areal.fleet.client import GenerateResult, RolloutClient, ServerError
from megatron_areal.fleet.routing import ServerPool
from megatron_areal.launch.embedded import start_embedded
from megatron_areal.model.assets import make_tiny_model
from megatron_areal.rollout.request import VersionParser, generate_sample
from megatron_areal.server.weights import read_safetensors
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.wire import WeightUpdateGroup

KEY = "k"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-models")
    return (make_tiny_model(root / "a", "qwen2", seed=0, max_position_embeddings=4096),
            make_tiny_model(root / "b", "qwen2", seed=1, max_position_embeddings=4096))


@pytest.fixture(scope="module")
def server(models):
    with start_embedded(models[0], args=["--api-key", KEY, "--context-length", "4096", "--weight-version", "0"]) as s:
        yield s


@pytest.fixture
def arun(server):
    """Run ``fn(client)`` with a client of the module's server in a fresh event loop."""
    def run(fn):
        async def main():
            async with RolloutClient(server.url, api_key=KEY, timeout_s=60) as client:
                return await fn(client)
        return asyncio.run(main())
    return run


def test_generate_and_info(arun, server) -> None:
    async def body(c: RolloutClient):
        res = await c.generate([1, 2, 3], {"max_new_tokens": 6, "temperature": 0.5, "ignore_eos": True})
        return res, await c.weight_version(), await c.health(), await c.load(), await c.model_info()
    res, version, healthy, load, info = arun(body)
    assert len(res.output_ids) == len(res.output_logprobs) == 6 and res.finish_reason == "length"
    assert res.output_versions == ["0"] * 6 and res.prompt_tokens == 3 and res.completion_tokens == 6
    assert all(lp <= 0 for lp in res.output_logprobs)
    assert version == "0" and healthy and load == 0 and info["architectures"] == ["Qwen2ForCausalLM"]


def test_pause_resume_and_disk_update(arun, server, models) -> None:
    async def body(c: RolloutClient):
        long = asyncio.create_task(c.generate([5, 6], {"max_new_tokens": 3000, "ignore_eos": True}, rid="r1"))
        while await c.load() == 0:
            await asyncio.sleep(0.02)
        await c.pause()
        partial = await long
        waiting = asyncio.create_task(c.generate([5, 6] + partial.output_ids, {"max_new_tokens": 4,
                                                                               "ignore_eos": True}))
        await weight_calls(c).update_weights_from_disk(str(models[1]), weight_version="1")
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await c.resume()
        rest = await waiting
        await weight_calls(c).update_weights_from_disk(str(models[0]), weight_version="0")
        return partial, rest
    partial, rest = arun(body)
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 3000
    assert rest.finish_reason == "length" and rest.output_versions == ["1"] * 4


def test_abort_all(arun, server) -> None:
    async def body(c: RolloutClient):
        tasks = [asyncio.create_task(c.generate([1], {"max_new_tokens": 3000, "ignore_eos": True}))
                 for _ in range(3)]
        while await c.load() < 3:
            await asyncio.sleep(0.02)
        await c.abort_all()
        return await asyncio.gather(*tasks)
    assert all(r.finish_reason == "abort" for r in arun(body))


def test_distributed_update_through_client(arun, server, models) -> None:
    new = read_safetensors(models[1])
    names = list(new)
    port = free_port()

    async def body(c: RolloutClient):
        with ThreadPoolExecutor(1) as ex:
            joining = asyncio.get_running_loop().run_in_executor(ex, lambda: WeightUpdateGroup(
                master_address="127.0.0.1", master_port=port, rank=0, world_size=2, timeout_s=60))
            await weight_calls(c).init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                              world_size=2)
            group = await joining
            await weight_calls(c).begin_weight_update()
            update = asyncio.create_task(weight_calls(c).update_weights_from_distributed(
                names=names, dtypes=["float32"] * len(names), shapes=[list(new[n].shape) for n in names],
                weight_version="7"))
            for n in names:
                await asyncio.get_running_loop().run_in_executor(ex, group.broadcast, new[n].clone())
            await update
            await weight_calls(c).end_weight_update()
            await weight_calls(c).destroy_weights_update_group()
            group.destroy()
        return await c.weight_version()
    assert arun(body) == "7"


def test_errors_name_the_server(server) -> None:
    async def body():
        async with RolloutClient(server.url, api_key="wrong") as c:
            with pytest.raises(ServerError, match="HTTP 401") as e:
                await c.generate([1], {})
            assert server.url in str(e.value) and e.value.status == 401
        dead = f"http://127.0.0.1:{free_port()}"
        async with RolloutClient(dead, control_timeout_s=5) as c:
            with pytest.raises(ServerError, match=dead):
                await c.pause()
            assert not await c.health()
        async with RolloutClient(server.url, api_key=KEY) as c:
            with pytest.raises(ServerError, match="update_weights_from_disk.*no \\*.safetensors"):
                await weight_calls(c).update_weights_from_disk("/nonexistent")
    asyncio.run(body())


def test_older_sglang_fallbacks() -> None:
    """SGLang 0.5.9+: /get_weight_version is 404 (read /model_info); 0.5.2: /get_load; no begin/end."""
    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "12", "model_path": "m"})

    async def get_load(_: web.Request) -> web.Response:
        return web.json_response([{"num_reqs": 2, "num_waiting_reqs": 3}])

    async def body():
        app = web.Application()
        app.router.add_get("/model_info", model_info)
        app.router.add_get("/get_load", get_load)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with RolloutClient(f"127.0.0.1:{port}") as c:
                assert await c.weight_version() == "12"
                assert await c.load() == 5
                await weight_calls(c).begin_weight_update()  # 404 from servers that don't need it: ignored
        finally:
            await runner.cleanup()
    asyncio.run(body())


def test_result_parsing_of_sglang_0523_reply() -> None:
    reply = {"text": "x", "output_ids": [4, 5, 6, 2], "meta_info": {
        "id": "a", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 9, "completion_tokens": 4,
        "weight_version": "3", "output_token_logprobs": [[-0.5, 4, None], [-1.0, 5, None], [-0.1, 6, None],
                                                         [-0.2, 2, None]],
        "weight_versions": [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 4}]}}
    r = GenerateResult.from_response(reply)
    assert r.finish_reason == "stop" and r.output_logprobs == [-0.5, -1.0, -0.1, -0.2]
    assert r.output_versions == ["2", "2", "3", "3"] and r.prompt_tokens == 9
    bare = GenerateResult.from_response({"output_ids": [1], "meta_info": {
        "finish_reason": {"type": "abort", "message": "m"}, "weight_version": "5",
        "output_token_logprobs": [[-0.3, 1, None]]}})
    assert bare.finish_reason == "abort" and bare.output_versions == ["5"] and bare.prompt_tokens == 0


# ---- a misbehaving server: its malformed replies are its failure, not the run's ----------------
def _reply(ids: list, logprobs: list, **meta) -> dict:
    return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0",
                                             "output_token_logprobs": logprobs, **meta}}


MALFORMED = {
    # what an all-NaN model answers: JSON has no NaN, so the server writes null
    "null-logprobs": _reply([5, 6], [[None, 5, None], [None, 6, None]]),
    "string-logprob": _reply([5], [["-0.5", 5, None]]),
    "string-token": _reply(["5"], [[-0.5, 5, None]]),
    "meta-not-object": {"output_ids": [5], "meta_info": [1, 2]},
    "span-without-start": _reply([5], [[-0.5, 5, None]], weight_versions=[{"version": "1"}]),
    "fewer-logprobs": _reply([5, 6], [[-0.5, 5, None]]),
    "no-logprobs": {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}}},
    "nan-literal": "{\"output_ids\": [5], \"meta_info\": {\"output_token_logprobs\": [[NaN, 5, null]]}}",
    "not-json": "{\"output_ids\": [5",
}


async def _misbehaving_server(reply: dict | str) -> tuple[web.AppRunner, str]:
    """A real HTTP server whose /generate answers ``reply`` (JSON content type) and whose /health is 200."""
    async def generate(_: web.Request) -> web.Response:
        text = reply if isinstance(reply, str) else json.dumps(reply)
        return web.Response(text=text, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_reply_is_a_server_error_naming_the_server(name: str) -> None:
    async def body():
        runner, url = await _misbehaving_server(MALFORMED[name])
        try:
            async with RolloutClient(url) as c:
                with pytest.raises(ServerError, match="malformed") as e:
                    await c.generate([1, 2], {"max_new_tokens": 2})
                assert url in str(e.value) and e.value.status is None
        finally:
            await runner.cleanup()
    asyncio.run(body())


def _sample(pool, rid: str):
    async def running() -> None:
        return None
    return generate_sample(pool, [1, 2, 3], {"temperature": 0.0}, 4, rid, running, VersionParser(0))


def test_sample_after_malformed_replies_is_retried_elsewhere_and_the_server_dropped(server) -> None:
    async def body():
        runner, bad_url = await _misbehaving_server(MALFORMED["null-logprobs"])
        try:
            async with RolloutClient(bad_url) as bad, RolloutClient(server.url, api_key=KEY, timeout_s=60) as good:
                pool = ServerPool([bad, good])
                bad_slot = pool.slots[0]
                for attempt in range(3):
                    pool.mark_up(bad_slot)  # what the health probe does: the bad server's /health is 200
                    out = await _sample(pool, f"s{attempt}")  # the bad server is picked first (index 0)
                    assert len(out.output_ids) == 4 and all(lp <= 0 for lp in out.output_logprobs)
                assert [s.url for s in pool.slots] == [server.url], "dropped after three failures in a row"
                assert pool.removed == 1 and "malformed" in bad_slot.last_error
        finally:
            await runner.cleanup()
    asyncio.run(body())


def test_a_server_that_recovers_is_not_dropped(server) -> None:
    """Failures separated by a good answer are not 'in a row'."""
    async def body():
        async with RolloutClient(server.url, api_key=KEY, timeout_s=60) as good:
            pool = ServerPool([good])
            slot = pool.slots[0]
            for attempt in range(5):
                pool.mark_down(slot, "connection reset")
                pool.mark_up(slot)
                await _sample(pool, f"r{attempt}")
            assert pool.slots == [slot] and slot.healthy and slot.strikes == 0
    asyncio.run(body())
