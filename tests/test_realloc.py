"""Weight transfer from a TP2 x PP2 trainer to two real embedded servers.

One spawned 4-process gloo trainer (the conversion's ``WorkerPool``) runs a tiny Llama built with
the actor's ``build_model``, loaded from HF and then perturbed so the servers' initial weights are
stale. Each sync is checked against ``convert mcore-to-hf`` of the trainer's weights (a Megatron
checkpoint saved by the trainer and converted in this process): per-tensor sha256 from the
servers' checksum endpoint, the weight version, and greedy output against transformers.

The worker pool and the servers are started once per module (they are slow to start); every test
starts from the same state all the same (``world``): a fresh trainer model and ``WeightSync``, and
two live servers holding the base model at version ``init``, so any test runs alone with ``-k``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.request
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(400)

TP, PP = 2, 2
_STATE: dict[str, Any] = {}  # per worker process: the trainer's model and WeightSync


# ---- trainer side (runs on every rank of the pool) ------------------------------------------
def _w_setup(model_dir: str, urls: list[str], bucket_mb: float, disk_dir: str, tp: int = TP, pp: int = PP,
             flat: bool = True, transfer: str = "auto") -> None:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    for key in ("sync", "disk"):  # a new layout in the same processes
        if key in _STATE:
            _STATE.pop(key).close()
    groups = init_parallel(tp=tp, pp=pp, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp)
    config = WeightsConfig(bucket_mb=bucket_mb, timeout_s=10.0, master_address="127.0.0.1", flattened_bucket=flat,
                           transfer=transfer)
    disk = WeightsConfig(method="disk", disk_dir=disk_dir, timeout_s=30.0, master_address="127.0.0.1")
    _STATE.update(groups=groups, arch=arch, chunks=chunks, model_dir=model_dir,
                  sync=WeightSync(chunks, arch, groups, urls, config=config),
                  disk=WeightSync(chunks, arch, groups, urls, config=disk, template_dir=model_dir))
    _w_step(0)


@torch.no_grad()
def _w_step(step: int) -> None:
    """Stand-in for an optimizer step: a seeded change of every parameter, consistent across TP."""
    from megatron_areal.model import mapping
    from megatron_areal.model.weights import named_global_params

    groups = _STATE["groups"]
    for chunk in _STATE["chunks"]:
        for name, p in named_global_params(chunk):
            split = mapping.tp_dim(name) is not None
            seed = zlib.crc32(name.encode()) * 1000 + step * 10 + (groups.tp_rank if split else 0)
            g = torch.Generator().manual_seed(seed)
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _w_save(ckpt_dir: str) -> None:
    import torch.distributed as dist

    from megatron_areal.checkpoint import dist_ckpt

    dist_ckpt.save_model(_STATE["chunks"], ckpt_dir)
    if dist.get_rank() == 0:
        groups = _STATE["groups"]
        dist_ckpt.write_meta(Path(ckpt_dir), _STATE["arch"], Path(_STATE["model_dir"]), torch.float32,
                             groups.tp, groups.pp)
    dist.barrier()


@contextlib.contextmanager
def _signal_after_first_send(pid: int, signum: int) -> Iterator[None]:
    """Within the block, this trainer rank's first point-to-point send of a weight push (``dist.isend``: the
    shard push's first bucket, once the servers were told what will arrive) is followed by ``signum`` to
    ``pid``: a fault at an exact point in the middle of the push. (The servers announce nothing before the
    whole update is installed, so a signal from outside could only race the push.)"""
    import torch.distributed as dist

    original = dist.isend

    def isend(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        if dist.isend is isend:
            dist.isend = original
            os.kill(pid, signum)
        return work

    dist.isend = isend
    try:
        yield
    finally:
        dist.isend = original


def _w_sync(version: str, pid: int | None = None, signum: int = signal.SIGKILL,
            which: str = "sync") -> dict[str, Any]:
    """One sync; with ``pid``, stage 0's head sends ``signum`` to that server after its first bucket left."""
    sync = _STATE[which]
    fault = pid is not None and sync.is_head and sync.groups.pp_rank == 0
    with _signal_after_first_send(pid, signum) if fault else contextlib.nullcontext():
        r = sync.sync(version)
    return {"servers": r.servers, "dropped": r.dropped, "bytes": r.bytes_sent, "buckets": r.buckets,
            "max_bucket": r.max_bucket_bytes, "wire": r.wire_bytes, "peak": r.peak_buffer_bytes}


def _w_sync_stages_meeting(version: str, flag_dir: str, wait_s: float = 30.0) -> dict[str, Any]:
    """One stage-heads sync in which stage 0's head, right after posting its first bucket, waits (at most
    ``wait_s``) for stage 1's head to have posted one too, while stage 1's head marks its first post in
    ``flag_dir``: whether stage 0's head saw it says whether the stages stream at the same time."""
    import time

    from megatron_areal.weights import link

    sync = _STATE["sync"]
    stage, original, seen = sync.groups.pp_rank, link.StageLink.post, {}
    flag = Path(flag_dir) / "stage1-posted"

    def post(self, bucket, version):
        pending = original(self, bucket, version)
        if not seen:
            seen["posted"] = True
            if stage == 1:
                flag.touch()
            else:
                deadline = time.monotonic() + wait_s
                while not flag.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                seen["met"] = flag.exists()
        return pending

    if sync.is_head:
        link.StageLink.post = post
    try:
        r = sync.sync(version)
    finally:
        link.StageLink.post = original
    return {"stage": stage, "head": sync.is_head, "met": seen.get("met"), "servers": r.servers,
            "dropped": r.dropped}


def _w_add(url: str) -> list[str]:
    _STATE["sync"].add_server(url)
    return list(_STATE["sync"].servers)


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    for key in ("sync", "disk"):
        if key in _STATE:
            _STATE.pop(key).close()
    teardown_parallel()


# ---- test side -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model and the 4-rank trainer pool (its ranks keep their model between calls)."""
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("realloc") / "model", "llama", seed=3)
    pool = WorkerPool(TP * PP, timeout_s=300)
    try:
        yield {"model": model, "pool": pool}
        pool.run(_w_close)
    finally:
        pool.close()


@pytest.fixture(scope="module")
def servers(trainer: dict[str, Any]):
    """Two embedded servers; a test may kill one or put a new one in its place (all stopped at the end)."""
    running = _start_servers(trainer["model"], 2)
    try:
        yield running
    finally:
        for s in running:
            s.stop()


def _start_servers(model: Path, n: int) -> list[Any]:
    from megatron_areal.launch.embedded import start_embedded

    if n == 0:
        return []
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda _: start_embedded(model, args=["--weight-version", "init"]), range(n)))


def _reset(url: str, model: Path) -> None:
    """Back to the base model at version ``init``, as a freshly started server."""
    from megatron_areal.fleet.client import RolloutClient
    from megatron_areal.weights.endpoints import weight_calls

    async def go() -> None:
        async with RolloutClient(url) as c:
            await c.pause()
            await weight_calls(c).begin_weight_update()
            await weight_calls(c).update_weights_from_disk(str(model), weight_version="init")
            await weight_calls(c).end_weight_update()
            await c.resume()

    asyncio.run(go())


@pytest.fixture
def world(trainer: dict[str, Any], servers: list[Any], tmp_path: Path) -> dict[str, Any]:
    """The same start for every test: two live servers on the base weights, a fresh trainer model
    (perturbed, so the servers are stale) and fresh ``WeightSync`` objects over both servers."""
    dead = [i for i, s in enumerate(servers) if s.proc.poll() is not None]
    for i, fresh in zip(dead, _start_servers(trainer["model"], len(dead))):
        servers[i] = fresh
    for s in servers:
        _reset(s.url, trainer["model"])
    # small buckets: the tiny model travels in many of them
    trainer["pool"].run(_w_setup, str(trainer["model"]), [s.url for s in servers], 0.05, str(tmp_path / "disk"))
    return {"root": tmp_path, "model": trainer["model"], "servers": servers, "pool": trainer["pool"]}


def _reference(world: dict[str, Any], name: str) -> Path:
    """``convert mcore-to-hf`` of the trainer's current weights."""
    from megatron_areal.convert.convert import mcore_to_hf

    ckpt = world["root"] / f"ckpt-{name}"
    ckpt.mkdir()
    world["pool"].run(_w_save, str(ckpt))
    return mcore_to_hf(ckpt, world["root"] / f"hf-{name}")


def _get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def _assert_serves(url: str, hf_dir: Path, version: str) -> None:
    from megatron_areal.server.weights import read_safetensors, tensor_checksum

    reply = _get(url, "/weights_checksum")
    assert reply["weight_version"] == version
    want = {n: tensor_checksum(t) for n, t in read_safetensors(hf_dir).items()}
    got = {n: v["sha256"] for n, v in reply["checksums"].items()}
    assert got == want, f"{url}: tensors differ: {sorted(n for n in want if got.get(n) != want[n])[:5]}"


def _greedy(url: str, prompt: list[int], n: int) -> list[int]:
    from megatron_areal.fleet.client import RolloutClient

    async def go() -> list[int]:
        async with RolloutClient(url) as c:
            r = await c.generate(prompt, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
            return r.output_ids

    return asyncio.run(go())


def _hf_greedy(hf_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_sync_matches_conversion_on_both_servers(world: dict[str, Any]) -> None:
    urls = [s.url for s in world["servers"]]
    before = _get(urls[0], "/weights_checksum")["checksums"]
    results = world["pool"].run(_w_sync, "1")
    r = results[0]
    assert r["servers"] == urls and not r["dropped"]
    assert r["buckets"] > 4 and r["max_bucket"] <= 0.05 * 2**20  # many small buckets, none over the size
    # every trainer rank sent its own share (no stage head gathers), within a bounded bucket memory
    assert len(r["wire"]) == 4 and max(r["wire"]) <= 1.25 * sum(r["wire"]) / 4, r["wire"]
    assert r["peak"] <= 2 * 0.05 * 2**20 + 1, r["peak"]
    ref = _reference(world, "v1")
    assert _get(urls[0], "/weights_checksum")["checksums"] != before  # the weights really changed
    prompt = [5, 17, 33, 2, 60, 9]
    expected = _hf_greedy(ref, prompt, 12)
    for url in urls:
        _assert_serves(url, ref, "1")
        assert _greedy(url, prompt, 12) == expected


def test_stage_head_path_matches_conversion(world: dict[str, Any]) -> None:
    """The path SGLang gets (stage heads gather and broadcast whole tensors), here into embedded servers."""
    urls = [s.url for s in world["servers"]]
    world["pool"].run(_w_setup, str(world["model"]), urls, 0.05, str(world["root"] / "disk-heads"), TP, PP, True,
                      "stage_heads")
    r = world["pool"].run(_w_sync, "1")[0]
    assert r["servers"] == urls and not r["dropped"] and r["wire"] == []  # no shard push
    ref = _reference(world, "heads")
    for url in urls:
        _assert_serves(url, ref, "1")


def test_stage_heads_stream_at_the_same_time(world: dict[str, Any]) -> None:
    """SGLang's path with PP2: stage 1's head streams while stage 0's head is still mid-push (each stage's head
    has its own group with each server), and both servers end up with the conversion's weights."""
    urls = [s.url for s in world["servers"]]
    world["pool"].run(_w_setup, str(world["model"]), urls, 0.05, str(world["root"] / "disk-heads"), TP, PP, True,
                      "stage_heads")
    results = world["pool"].run(_w_sync_stages_meeting, "1", str(world["root"]))
    stage0_head = next(r for r in results if r["head"] and r["stage"] == 0)
    assert stage0_head["met"], "stage 1's head posted nothing while stage 0's head was mid-push: stages in turn"
    assert results[0]["servers"] == urls and not results[0]["dropped"]
    ref = _reference(world, "heads-at-once")
    for url in urls:
        _assert_serves(url, ref, "1")


def test_disk_path_and_next_version(world: dict[str, Any]) -> None:
    world["pool"].run(_w_step, 1)
    world["pool"].run(_w_sync, "2", None, signal.SIGKILL, "disk")
    ref = _reference(world, "v2")
    for s in world["servers"]:
        _assert_serves(s.url, ref, "2")
    assert [p.name for p in (world["root"] / "disk").iterdir()] == ["v2"]  # older versions pruned


def test_mismatched_bucket_is_refused_and_old_weights_stay(world: dict[str, Any]) -> None:
    from megatron_areal.fleet.client import RolloutClient, ServerError
    from megatron_areal.util.netutil import free_port
    from megatron_areal.weights.endpoints import weight_calls
    from megatron_areal.weights.wire import WeightUpdateGroup

    url = world["servers"][0].url
    before = _get(url, "/weights_checksum")
    port = free_port("127.0.0.1")
    bad = [(["model.layers.0.mlp.up_proj.weight"], [[3, 3]], "shape"),
           (["model.layers.0.mlp.not_a_weight"], [[4]], "unknown")]

    async def go() -> list[str]:
        messages = []
        async with RolloutClient(url) as c:
            init = asyncio.create_task(weight_calls(c).init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="bad"))
            group = await asyncio.to_thread(WeightUpdateGroup, master_address="127.0.0.1", master_port=port,
                                            rank=0, world_size=2, group_name="bad", timeout_s=20)
            await init
            await weight_calls(c).begin_weight_update()  # SGLang 0.5.23 refuses updates outside begin/end
            for names, shapes, _ in bad:
                call = asyncio.create_task(weight_calls(c).update_weights_from_distributed(
                    names=names, dtypes=["float32"], shapes=shapes, group_name="bad", weight_version="bad"))
                await asyncio.to_thread(group.broadcast, torch.ones(shapes[0]))
                with pytest.raises(ServerError) as err:
                    await call
                messages.append(str(err.value))
            await weight_calls(c).end_weight_update()
            await weight_calls(c).destroy_weights_update_group("bad")
            group.destroy()
        return messages

    messages = asyncio.run(go())
    for message, (names, _, what) in zip(messages, bad, strict=True):
        assert names[0] in message, f"refusal should name the tensor ({what}): {message}"
    after = _get(url, "/weights_checksum")
    assert after == before  # same tensors and same version


def test_killed_server_is_dropped_and_sync_goes_on(world: dict[str, Any]) -> None:
    from megatron_areal.launch.embedded import start_embedded

    survivor, victim = world["servers"]
    world["pool"].run(_w_step, 2)
    r = world["pool"].run(_w_sync, "3", victim.proc.pid)[0]
    assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    assert list(r["dropped"]) == [victim.url] and victim.url in r["dropped"][victim.url]
    assert r["servers"] == [survivor.url]
    _assert_serves(survivor.url, _reference(world, "v3"), "3")

    world["pool"].run(_w_step, 3)
    r = world["pool"].run(_w_sync, "4")[0]
    assert r["servers"] == [survivor.url] and not r["dropped"]
    ref = _reference(world, "v4")
    _assert_serves(survivor.url, ref, "4")

    # a server that joins later holds the current weights before it is a member
    late = start_embedded(world["model"], args=["--weight-version", "init"])
    world["servers"][1] = late  # stopped with the others
    members = world["pool"].run(_w_add, late.url)[0]
    assert members == [survivor.url, late.url]
    _assert_serves(late.url, ref, "4")
    world["pool"].run(_w_step, 4)
    r = world["pool"].run(_w_sync, "5")[0]
    assert r["servers"] == [survivor.url, late.url] and not r["dropped"]
    ref = _reference(world, "v5")
    for url in r["servers"]:
        _assert_serves(url, ref, "5")


def test_server_that_stops_answering_times_out(world: dict[str, Any]) -> None:
    """A frozen server (SIGSTOP: its sockets stay open, nothing answers) is named after the timeout."""
    survivor, frozen = world["servers"]
    world["pool"].run(_w_step, 5)
    try:
        r = world["pool"].run(_w_sync, "6", frozen.proc.pid, signal.SIGSTOP)[0]
    finally:
        frozen.proc.kill()
        frozen.proc.wait(timeout=30)
    assert list(r["dropped"]) == [frozen.url] and frozen.url in r["dropped"][frozen.url]
    assert r["servers"] == [survivor.url]
    _assert_serves(survivor.url, _reference(world, "v6"), "6")


def test_data_parallel_replicas_send_once(world: dict[str, Any]) -> None:
    """TP2 x DP2: only replica 0's head sends; the other replica waits and agrees on the outcome.

    This layout also sends one broadcast per tensor (no flattened buckets), as SGLang before 0.5.23 needs.
    """
    survivor = world["servers"][0]
    world["pool"].run(_w_setup, str(world["model"]), [survivor.url], 0.05, str(world["root"] / "disk-dp"), 2, 1,
                      False)  # the same processes in another layout
    from megatron_areal.server.weights import read_safetensors

    results = world["pool"].run(_w_sync, "7")
    assert results[0]["servers"] == [survivor.url] and not results[0]["dropped"]
    ref = _reference(world, "v7")
    _assert_serves(survivor.url, ref, "7")
    model_bytes = sum(t.numel() * t.element_size() for t in read_safetensors(ref).values())
    assert [r["bytes"] for r in results] == [model_bytes] * 4  # sent once, and every rank knows it
