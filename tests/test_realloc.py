"""Weight transfer from a TP2 x PP2 trainer to two real embedded servers.

One spawned 4-process gloo trainer (the conversion's ``WorkerPool``) runs a tiny Llama built with
the actor's ``build_model``, loaded from HF and then perturbed so the servers' initial weights are
stale. Each sync is checked against ``convert mcore-to-hf`` of the trainer's weights (a Megatron
checkpoint saved by the trainer and converted in this process): per-tensor sha256 from the
servers' checksum endpoint, the weight version, and greedy output against transformers.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
import zlib
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
             flat: bool = True) -> None:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.realloc.config import ReallocConfig
    from megatron_areal.realloc.sync import WeightSync

    for key in ("sync", "disk"):  # a new layout in the same processes
        if key in _STATE:
            _STATE.pop(key).close()
    groups = init_parallel(tp=tp, pp=pp, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, tp=tp, pp=pp, pp_rank=groups.pp_rank)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp)
    config = ReallocConfig(bucket_mb=bucket_mb, timeout_s=10.0, master_address="127.0.0.1", flattened_bucket=flat)
    disk = ReallocConfig(method="disk", disk_dir=disk_dir, timeout_s=30.0, master_address="127.0.0.1")
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

    from megatron_areal.convert import dist_ckpt

    dist_ckpt.save_model(_STATE["chunks"], ckpt_dir)
    if dist.get_rank() == 0:
        groups = _STATE["groups"]
        dist_ckpt.write_meta(Path(ckpt_dir), _STATE["arch"], Path(_STATE["model_dir"]), torch.float32,
                             groups.tp, groups.pp)
    dist.barrier()


def _w_sync(version: str, pid: int | None = None, signum: int = signal.SIGKILL,
            which: str = "sync") -> dict[str, Any]:
    """One sync; with ``pid``, stage 0's head sends ``signum`` to that server after its first bucket."""
    sync = _STATE[which]
    if pid is not None and sync.is_head and sync.groups.pp_rank == 0:
        def signal_after_first(index: int, bucket: Any) -> None:
            if index == 0:
                os.kill(pid, signum)
        sync.on_bucket = signal_after_first
    try:
        r = sync.sync(version)
    finally:
        sync.on_bucket = None
    return {"servers": r.servers, "dropped": r.dropped, "bytes": r.bytes_sent, "buckets": r.buckets,
            "max_bucket": r.max_bucket_bytes}


def _w_add(url: str) -> list[str]:
    _STATE["sync"].add_server(url)
    return list(_STATE["sync"].servers)


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    for key in ("sync", "disk"):
        _STATE.pop(key).close()
    teardown_parallel()


# ---- test side -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    from megatron_areal.assets import make_tiny_model
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.netutil import free_port
    from megatron_areal.server.local import start_embedded

    root = tmp_path_factory.mktemp("realloc")
    model = make_tiny_model(root / "model", "llama", seed=3)
    ports = [free_port() for _ in range(2)]
    # the servers start while the trainer builds its model (it contacts them only on the first sync)
    with ThreadPoolExecutor(2) as ex:
        starting = [ex.submit(start_embedded, model, port=port, args=["--weight-version", "init"]) for port in ports]
        pool = WorkerPool(TP * PP, timeout_s=300)
        try:
            # small buckets: the tiny model travels in many of them
            pool.run(_w_setup, str(model), [f"http://127.0.0.1:{p}" for p in ports], 0.05, str(root / "disk"))
        finally:
            servers = [f.result() for f in starting]
    try:
        yield {"root": root, "model": model, "servers": servers, "pool": pool}
        pool.run(_w_close)
    finally:
        pool.close()
        for s in servers:
            s.stop()


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
    from megatron_areal.rollout.client import RolloutClient

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
    ref = _reference(world, "v1")
    assert _get(urls[0], "/weights_checksum")["checksums"] != before  # the weights really changed
    prompt = [5, 17, 33, 2, 60, 9]
    expected = _hf_greedy(ref, prompt, 12)
    for url in urls:
        _assert_serves(url, ref, "1")
        assert _greedy(url, prompt, 12) == expected


def test_disk_path_and_next_version(world: dict[str, Any]) -> None:
    world["pool"].run(_w_step, 1)
    world["pool"].run(_w_sync, "2", None, signal.SIGKILL, "disk")
    ref = _reference(world, "v2")
    for s in world["servers"]:
        _assert_serves(s.url, ref, "2")
    assert [p.name for p in (world["root"] / "disk").iterdir()] == ["v2"]  # older versions pruned


def test_mismatched_bucket_is_refused_and_old_weights_stay(world: dict[str, Any]) -> None:
    from megatron_areal.netutil import free_port
    from megatron_areal.realloc.group import WeightUpdateGroup
    from megatron_areal.rollout.client import RolloutClient, ServerError

    url = world["servers"][0].url
    before = _get(url, "/weights_checksum")
    port = free_port("127.0.0.1")
    bad = [(["model.layers.0.mlp.up_proj.weight"], [[3, 3]], "shape"),
           (["model.layers.0.mlp.not_a_weight"], [[4]], "unknown")]

    async def go() -> list[str]:
        messages = []
        async with RolloutClient(url) as c:
            init = asyncio.create_task(c.init_weights_update_group(
                master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name="bad"))
            group = await asyncio.to_thread(WeightUpdateGroup, master_address="127.0.0.1", master_port=port,
                                            rank=0, world_size=2, group_name="bad", timeout_s=20)
            await init
            await c.begin_weight_update()  # SGLang 0.5.23 refuses updates outside begin/end
            for names, shapes, _ in bad:
                call = asyncio.create_task(c.update_weights_from_distributed(
                    names=names, dtypes=["float32"], shapes=shapes, group_name="bad", weight_version="bad"))
                await asyncio.to_thread(group.broadcast, torch.ones(shapes[0]))
                with pytest.raises(ServerError) as err:
                    await call
                messages.append(str(err.value))
            await c.end_weight_update()
            await c.destroy_weights_update_group("bad")
            group.destroy()
        return messages

    messages = asyncio.run(go())
    for message, (names, _, what) in zip(messages, bad, strict=True):
        assert names[0] in message, f"refusal should name the tensor ({what}): {message}"
    after = _get(url, "/weights_checksum")
    assert after == before  # same tensors and same version


def test_killed_server_is_dropped_and_sync_goes_on(world: dict[str, Any]) -> None:
    from megatron_areal.server.local import start_embedded

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
    world["servers"][1] = late
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
                      False)
    from megatron_areal.server.weights import read_safetensors

    results = world["pool"].run(_w_sync, "7")
    assert results[0]["servers"] == [survivor.url] and not results[0]["dropped"]
    ref = _reference(world, "v7")
    _assert_serves(survivor.url, ref, "7")
    model_bytes = sum(t.numel() * t.element_size() for t in read_safetensors(ref).values())
    assert [r["bytes"] for r in results] == [model_bytes] * 4  # sent once, and every rank knows it
