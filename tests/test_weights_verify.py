"""``weights.verify``: after a push every server's checksum of every tensor it installed is compared with the
trainer's, computed on the ranks that hold each piece (``weights/verify.py``).

A spawned TP2 x PP2 gloo trainer pushes a tiny Llama into two real embedded servers. References: the HF
tensors of the model folder (what the count of verified tensors must be), and a push corrupted on the wire:
the test's hook flips the lowest mantissa bit of one tensor in one bucket as it leaves the stage head (the
trainer's own weights untouched), which the servers install (a finite value, so nothing refuses it), and the
verification must stop the push naming that tensor, a server and the version. The main job's metric is
checked in ``test_main_job_logs_verified_tensors_every_step``. The checksum itself (slices add up to the
whole; a flipped lane changes it) is checked against a hand-made split of a tensor.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytestmark = pytest.mark.timeout(600)

TP, PP = 2, 2
_STATE: dict[str, Any] = {}


# ---- trainer side (every rank of the pool) ---------------------------------------------------------------
def _w_setup(model_dir: str, urls: list[str]) -> None:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    groups = init_parallel(tp=TP, pp=PP, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp)
    with torch.no_grad():  # new weights, so the servers' start is stale
        for chunk in chunks:
            for p in chunk.parameters():
                p.mul_(1.25)
    config = WeightsConfig(bucket_mb=0.05, timeout_s=20.0, master_address="127.0.0.1", verify=True, max_retries=0)
    _STATE.update(sync=WeightSync(chunks, arch, groups, urls, config=config))


def _w_sync(version: str, corrupt_bucket: int | None = None) -> dict[str, Any]:
    """One sync; with ``corrupt_bucket``, stage 1's head flips a bit of that bucket's last tensor on the wire."""
    from megatron_areal.weights.push import WeightSyncError
    from tests.wire_corruption import corrupt_on_the_wire

    sync = _STATE["sync"]
    corrupting = corrupt_bucket is not None and sync.is_head and sync.groups.pp_rank == 1
    hook = corrupt_on_the_wire(bucket_index=corrupt_bucket or 0) if corrupting else contextlib.nullcontext({})
    with hook as corrupted:
        try:
            r = sync.sync(version)
            return {"verified": r.verified_tensors, "servers": r.servers, **corrupted}
        except WeightSyncError as e:
            return {"error": str(e), "type": type(e).__name__, **corrupted}


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    if "sync" in _STATE:
        _STATE.pop("sync").close()
    teardown_parallel()


# ---- test side --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("verify") / "model", "llama", seed=4)
    with ThreadPoolExecutor(2) as ex:
        servers = list(ex.map(lambda _: start_embedded(model, args=["--weight-version", "init"]), range(2)))
    pool = WorkerPool(TP * PP, timeout_s=300)
    try:
        pool.run(_w_setup, str(model), [s.url for s in servers])
        yield {"model": model, "servers": servers, "pool": pool}
        pool.run(_w_close)
    finally:
        pool.close()
        for s in servers:
            s.stop()


def _hf_tensor_count(model: Path) -> int:
    from safetensors import safe_open

    names = set()
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    return len(names)


def test_slice_sums_add_up_to_the_whole_and_a_flipped_bit_changes_it() -> None:
    from megatron_areal.weights.wire import add_sums, slice_sum

    whole = torch.randn(6, 10, 4).to(torch.bfloat16)
    for dim, cut in ((0, 2), (1, 7), (2, 1)):
        n = whole.shape[dim]
        parts = [slice_sum(whole.narrow(dim, 0, cut), whole.shape, dim, 0),
                 slice_sum(whole.narrow(dim, cut, n - cut), whole.shape, dim, cut)]
        assert add_sums(*parts) == slice_sum(whole), dim
    flipped = whole.clone()
    flipped.view(-1).view(torch.int16)[37] ^= 1
    assert slice_sum(flipped) != slice_sum(whole)
    swapped = whole.clone().view(-1)
    swapped[[3, 4]] = swapped[[4, 3]]
    assert swapped[3] != swapped[4] and slice_sum(swapped.view(whole.shape)) != slice_sum(whole)


def test_verified_push_checks_every_tensor_on_every_server(world: dict[str, Any]) -> None:
    results = world["pool"].run(_w_sync, "1")
    assert all("error" not in r for r in results), results
    # every HF tensor of the model folder (the tied output layer is not one), on both servers, on every rank
    expected = 2 * _hf_tensor_count(world["model"])
    assert [r["verified"] for r in results] == [expected] * (TP * PP), results


def test_a_slice_corrupted_on_the_wire_stops_the_push_naming_it(world: dict[str, Any]) -> None:
    results = world["pool"].run(_w_sync, "2", 1)
    name = next(r["name"] for r in results if "name" in r)
    urls = [s.url for s in world["servers"]]
    for r in results:  # every rank stops with the same error
        assert r.get("type") == "WeightMismatch", results
        assert f"tensor {name!r} on server " in r["error"] and "weights v2" in r["error"], r["error"]
        assert any(u in r["error"] for u in urls), r["error"]
    # a clean push afterwards verifies again (the servers took the corrupted bucket; the next push repairs it)
    again = world["pool"].run(_w_sync, "3")
    assert all(r.get("verified") for r in again), again


def test_verify_is_refused_for_sglang_at_load() -> None:
    from megatron_areal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weights.verify"):
        load_config(None, ["server.engine=sglang", "weights.verify=true"])


@pytest.mark.timeout(900)
def test_main_job_logs_verified_tensors_every_step(tmp_path: Path) -> None:
    from tests.test_main_job import STEPS, read_scalars, tiny_config

    config = tmp_path / "run.yaml"
    cfg = tiny_config(tmp_path / "run")
    cfg["weights"] = {"verify": True}
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "megatron_areal.cli", "train", str(config)], capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    counts = scalars.get("weights/verified_tensors")
    assert counts, f"no weights/verified_tensors among {sorted(scalars)}"
    from megatron_areal.model.assets import resolve_model

    expected = _hf_tensor_count(Path(resolve_model("tiny-llama")))  # one server
    assert counts == [(step, float(expected)) for step in range(1, STEPS + 1)], counts


def _w_checksums_of_layout(model_dir: str, tp: int, pp: int, ep: int) -> dict[str, str] | None:
    """The trainer's checksums of the model loaded from ``model_dir`` at a layout (rank 0's; None elsewhere)."""
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.verify import trainer_sums

    groups = init_parallel(tp=tp, pp=pp, backend="gloo", ep=ep, etp=1)
    try:
        arch = load_arch(model_dir)
        chunks = build_model(arch, groups, sequence_parallel=tp > 1)
        load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp, etp_rank=groups.etp_rank, etp_size=1)
        return trainer_sums(chunks, arch, groups, {}, None)
    finally:
        teardown_parallel()


@pytest.mark.parametrize("layout", [(2, 1, 2), (1, 2, 2), (2, 1, 4)], ids=["tp2-ep2", "pp2-ep2", "tp2-ep4"])
def test_trainer_checksums_of_a_moe_layout_equal_the_model_folders(layout: tuple[int, int, int],
                                                                   moe_pool: dict[str, Any]) -> None:
    """Added up from the slices each rank holds (TP shards, experts over EP and replicas), the trainer's checksums
    are those of the HF tensors transformers wrote: every tensor, no other."""
    from safetensors.torch import load_file

    from megatron_areal.weights.wire import format_sum, slice_sum

    reference = {}
    for f in moe_pool["model"].glob("*.safetensors"):
        reference.update({n: format_sum(slice_sum(t)) for n, t in load_file(str(f)).items()})
    got = moe_pool["pool"].run(_w_checksums_of_layout, str(moe_pool["model"]), *layout)[0]
    assert got == reference


@pytest.fixture(scope="module")
def moe_pool(tmp_path_factory: pytest.TempPathFactory):
    from megatron_areal.convert.spawn import WorkerPool
    from tests.tiny_moe import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path_factory.mktemp("verify-moe") / "model", seed=6)
    with WorkerPool(4, timeout_s=300) as pool:
        yield {"model": model, "pool": pool}


def test_checksum_route_refuses_an_unknown_kind(world: dict[str, Any]) -> None:
    import urllib.error
    import urllib.request

    url = world["servers"][0].url
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url + "/weights_checksum?kind=crc32", timeout=60)
    assert err.value.code == 400 and "kind" in err.value.read().decode()
