"""MoE weight push from a trainer at expert-parallel layouts to a real embedded server.

A spawned 4-process gloo trainer builds the tiny Qwen3-MoE (tests/tiny_moe.py: 8 experts, top-2)
with the actor's ``build_model`` at EP2, TP2 x EP2 x expert-TP2 and PP2 x EP2, loads it from HF,
perturbs every parameter (so the server's weights are stale and every expert differs from the file),
and pushes with ``WeightSync`` over the weight group (and once through a folder on disk). The
reference is the trainer's own weights through the conversion: a Megatron checkpoint the trainer
saves, turned into HF by ``convert mcore-to-hf`` in this process. Every tensor on the server, all
experts included, must have the reference's sha256, and the server's greedy tokens must be
transformers' on it.
"""
from __future__ import annotations

import json
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from test_realloc import _greedy, _hf_greedy
from tiny_moe import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe

pytestmark = pytest.mark.timeout(600)

# (tp, pp, ep, etp) on 4 ranks: EP spans data-parallel replicas; expert TP splits each expert
LAYOUTS = [(1, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1)]
_STATE: dict[str, Any] = {}


# ---- trainer side (every rank of the pool) ---------------------------------------------------
def _w_setup(model_dir: str, url: str, tp: int, pp: int, ep: int, etp: int, disk_dir: str = "",
             transfer: str = "auto") -> dict[str, int]:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    if "sync" in _STATE:
        _STATE.pop("sync").close()
    groups = init_parallel(tp=tp, pp=pp, backend="gloo", ep=ep, etp=etp)
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups, sequence_parallel=tp > 1)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp, etp_rank=groups.etp_rank, etp_size=groups.etp)
    _perturb(chunks, groups)
    config = WeightsConfig(bucket_mb=0.02, timeout_s=20.0, master_address="127.0.0.1", transfer=transfer)
    if disk_dir:
        config = WeightsConfig(method="disk", disk_dir=disk_dir, timeout_s=30.0)
    _STATE.update(groups=groups, arch=arch, chunks=chunks, model_dir=model_dir,
                  sync=WeightSync(chunks, arch, groups, [url], config=config, template_dir=model_dir))
    return {"dp": groups.dp_rank, "ep": groups.ep_rank, "etp": groups.etp_rank, "edp": groups.edp_rank}


@torch.no_grad()
def _perturb(chunks: list, groups: Any) -> None:
    """A seeded change of every parameter, the same on every copy of it (split ones: per slice)."""
    from megatron_areal.model import mapping
    from megatron_areal.model.weights import named_global_params

    for chunk in chunks:
        for name, p in named_global_params(chunk):
            split = mapping.tp_dim(name) is not None
            rank = (groups.etp_rank if mapping.is_expert(name) else groups.tp_rank) if split else 0
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 10 + rank)
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _w_sync(version: str) -> dict[str, Any]:
    r = _STATE["sync"].sync(version)
    return {"servers": r.servers, "dropped": r.dropped, "bytes": r.bytes_sent, "buckets": r.buckets}


def _w_save(ckpt_dir: str) -> None:
    import torch.distributed as dist

    from megatron_areal.checkpoint import dist_ckpt

    g = _STATE["groups"]
    dist_ckpt.save_model(_STATE["chunks"], ckpt_dir)
    if dist.get_rank() == 0:
        dist_ckpt.write_meta(Path(ckpt_dir), _STATE["arch"], Path(_STATE["model_dir"]), torch.float32,
                             g.tp, g.pp, dp=g.dp, ep=g.ep, etp=g.etp)
    dist.barrier()


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    if "sync" in _STATE:
        _STATE.pop("sync").close()
    teardown_parallel()


# ---- test side ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe-push") / "model", seed=4)


@pytest.fixture(scope="module")
def pool():
    from megatron_areal.convert.spawn import WorkerPool

    with WorkerPool(4, timeout_s=400) as p:
        yield p
        p.run(_w_close)


@pytest.fixture(scope="module")
def server(model: Path):
    from megatron_areal.launch.embedded import start_embedded

    s = start_embedded(model, args=["--weight-version", "init"])
    try:
        yield s
    finally:
        s.stop()


def _checksums(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/weights_checksum", timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("layout,method", [*((layout, "distributed") for layout in LAYOUTS), ((2, 1, 2, 2), "disk"),
                                           ((2, 1, 2, 2), "stage_heads")],
                         ids=lambda v: "tp{}-pp{}-ep{}-etp{}".format(*v) if isinstance(v, tuple) else v)
def test_every_expert_reaches_the_server_as_conversion_gives_it(layout, method, model, pool, server, tmp_path) -> None:
    coords = _push_and_compare(model, server.url, pool, layout, method, tmp_path)
    if layout == (1, 1, 2, 1):  # half the experts live on a rank of another data-parallel replica
        assert any(c["dp"] != 0 and c["edp"] == 0 for c in coords), coords


@pytest.mark.parametrize("make", [make_tiny_mixtral, make_tiny_qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_other_moe_families_reach_the_server_under_their_names(make, pool, tmp_path) -> None:
    """Mixtral's ``block_sparse_moe`` names and Qwen2-MoE's shared expert (split over TP) at TP2 x EP2 x ETP2."""
    from megatron_areal.launch.embedded import start_embedded

    folder = make(tmp_path / "model", seed=5)
    with start_embedded(folder, args=["--weight-version", "init"]) as s:
        _push_and_compare(folder, s.url, pool, (2, 1, 2, 2), "distributed", tmp_path)


def _push_and_compare(model: Path, url: str, pool, layout: tuple[int, int, int, int], method: str,
                      tmp_path: Path) -> list[dict[str, int]]:
    """Perturb the trainer's weights at ``layout``, push them, and compare every tensor on the server
    with ``convert mcore-to-hf`` of the trainer's checkpoint (sha256), then greedy tokens with
    transformers' on the converted folder; returns each rank's coordinates."""
    from megatron_areal.convert.convert import mcore_to_hf
    from megatron_areal.model.arch import load_arch
    from megatron_areal.server.weights import read_safetensors, tensor_checksum

    disk = str(tmp_path / "disk") if method == "disk" else ""
    transfer = "stage_heads" if method == "stage_heads" else "auto"  # distributed: the shard push
    coords = pool.run(_w_setup, str(model), url, *layout, disk, transfer)
    version = "".join(map(str, layout)) + str(len(method))  # integers, as the trainer pushes them
    results = pool.run(_w_sync, version)
    assert results[0]["servers"] == [url] and not results[0]["dropped"], results[0]

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    pool.run(_w_save, str(ckpt))
    ref = mcore_to_hf(ckpt, tmp_path / "hf")
    want = {n: tensor_checksum(t) for n, t in read_safetensors(ref).items()}
    start = {n: tensor_checksum(t) for n, t in read_safetensors(model).items()}
    reply = _checksums(url)
    got = {n: v["sha256"] for n, v in reply["checksums"].items()}
    assert reply["weight_version"] == version
    arch = load_arch(model)
    experts = [n for n in want if f".{arch.hf_moe_block}.experts." in n]
    assert len(experts) == 2 * 8 * 3  # 2 layers x 8 experts x gate/up/down
    assert all(want[n] != start[n] for n in want)  # every tensor was perturbed: a stale one would show
    assert got == want, f"differ: {sorted(n for n in want if got.get(n) != want[n])[:6]}"
    prompt = [5, 17, 33, 2, 60, 9]
    assert _greedy(url, prompt, 10) == _hf_greedy(ref, prompt, 10)
    return coords
