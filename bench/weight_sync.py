"""Weight sync from a TP2 x PP2 trainer to two embedded servers, against a raw gloo broadcast.

In one run, between the same processes: the trainer pushes its weights through ``WeightSync.sync``
(pause, every trainer rank cutting its own HF slices, buckets point to point, install, continue; the
shard push, ``weights.transfer: auto``), then each stage head broadcasts the same number of bytes in the
same bucket-sized pieces over a plain gloo group (``WeightUpdateGroup``) with nothing else, both stages
at once. The servers run the real embedded server in their main thread and the raw receiver in a side
thread. Before timing, the trainer's weights are perturbed and every server's per-tensor sha256 is
compared with the HF tensors the stage heads gather and convert (``weights/gather.py``, the conversion's
path): a difference exits non-zero without a RESULT line.

The trainer ranks' allocator is set as a long-running process settles (``_malloc_for``) for the timed syncs;
one more sync, untimed, maps every block over 64 KiB on its own to measure what a push holds at once.

Prints seconds per sync, bytes moved, the bytes each trainer rank sent, the ranks' peak extra memory
(resident-set high-water mark during that sync, and the push's own bucket buffers) against one bucket,
and the transfer plan's rows (dense and Qwen3-MoE at EP2, servers at TP1 and TP2).

    python bench/weight_sync.py [--hidden 512 --layers 8 --bucket-mb 16 --repeats 3 --tp 2 --pp 2]

Last lines: ``RESULT weight_sync_vs_raw <ratio>`` (raw seconds / sync seconds, medians) and
``RESULT weight_push_busiest_share <x>`` (the plan's, TP2 x PP2 to two servers at TP2).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_STATE: dict[str, Any] = {}


# ---- server processes: the embedded server plus a raw receiver thread ------------------------
def _raw_receiver(inbox: Any, outbox: Any) -> None:
    from megatron_areal.weights.wire import WeightUpdateGroup

    groups: dict[str, WeightUpdateGroup] = {}

    def run(kind: str, name: str, args: dict[str, Any]) -> None:
        if kind == "join":
            groups[name] = WeightUpdateGroup(group_name=name, backend="gloo", **args)
        else:  # receive the stage's pieces into one reused buffer, then meet the sender at a barrier
            buffer = torch.empty(max(args["pieces"]), dtype=torch.uint8)
            for n in args["pieces"]:
                groups[name].broadcast(buffer[:n], src=0)
            groups[name].barrier()
        outbox.put((kind, name))

    # one thread per job: the stages' groups run concurrently, as the server's update requests do
    while (job := inbox.get()) is not None:
        threading.Thread(target=run, args=job, daemon=True).start()


def _server_main(model: str, port: int, inbox: Any, outbox: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_areal.server import cli

    threading.Thread(target=_raw_receiver, args=(inbox, outbox), daemon=True).start()
    cli.main(["--model", model, "--port", str(port), "--weight-version", "init"])


# ---- trainer ranks (run through the conversion's WorkerPool) ---------------------------------
def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _t_setup(model_dir: str, urls: list[str], bucket_mb: float, tp: int, pp: int) -> None:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    groups = init_parallel(tp=tp, pp=pp, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, groups.tp_rank, groups.tp)
    config = WeightsConfig(bucket_mb=bucket_mb, timeout_s=300.0, master_address="127.0.0.1")
    _perturb(chunks, groups.tp_rank)  # the servers hold the HF weights: make a push change every tensor
    _STATE.update(groups=groups, arch=arch, chunks=chunks,
                  sync=WeightSync(chunks, arch, groups, urls, config=config))


@torch.no_grad()
def _perturb(chunks: list, tp_rank: int) -> None:
    """A seeded change of every parameter, the same on every TP rank for replicated ones."""
    import zlib

    from megatron_areal.model import mapping
    from megatron_areal.model.weights import named_global_params

    for chunk in chunks:
        for name, p in named_global_params(chunk):
            split = mapping.tp_dim(name) is not None
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 10 + (tp_rank if split else 0))
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _t_reference() -> dict[str, str]:
    """sha256 of every HF tensor as the stage heads gather and convert it (the conversion's path)."""
    from megatron_areal.server.weights import tensor_checksum
    from megatron_areal.weights.gather import stage_hf_tensors

    return {name: tensor_checksum(t) for name, t in stage_hf_tensors(_STATE["chunks"], _STATE["arch"],
                                                                      _STATE["groups"])}


def _malloc_for(memory: bool) -> None:
    """glibc's allocator for a timed sync, or for the one that measures memory.

    Timed: the thresholds a long-running process settles to (glibc raises them to these after it frees large
    blocks), so a push's temporary copies reuse freed memory as in a trainer that has run for a while.
    Measuring: every block over 64 KiB is mapped on its own and given back when freed, and freed memory is
    returned first, so the resident-set high-water mark during the sync is what the sync itself held at once.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameter numbers (malloc.h)
    libc.mallopt(m_mmap_threshold, 64 << 10 if memory else 32 << 20)
    libc.mallopt(m_trim_threshold, 128 << 10 if memory else 64 << 20)
    if memory:
        libc.malloc_trim(0)


def _t_sync(version: str, memory: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    sync = _STATE["sync"]
    _malloc_for(memory)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident-set high-water mark
    rss = _rss_kb("VmRSS")
    start = time.perf_counter()
    result = sync.sync(version)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": result.bytes_sent, "max_bucket": result.max_bucket_bytes,
            "parts": (result.gather_seconds, result.broadcast_seconds, result.reply_seconds),
            "extra_kb": _rss_kb("VmHWM") - rss, "wire": result.wire_bytes, "peak": result.peak_buffer_bytes,
            "head": sync.is_head, "stage": sync.groups.pp_rank}


def _t_record_pieces() -> list[int]:
    """Bucket sizes this rank sends in a shard push, round by round: its streams as the transfer plan of
    the servers the last sync reached cuts them (``weights.streams``), the buckets ``send_streams`` packs."""
    from megatron_areal.weights.streams import slice_bytes, streams_of

    shards = _STATE["sync"]._shards
    assert shards is not None and shards.plan is not None, "record the pieces after a shard push"
    mine = streams_of(shards.plan, shards.rank, bucket_bytes=shards.bucket_bytes, dtype=shards.dtype)
    rounds = max((len(s.buckets) for s in mine), default=0)
    pieces = [sum(slice_bytes(sl, shards.dtype) for _, sl in s.buckets[k]) for k in range(rounds)
              for s in mine if k < len(s.buckets)]
    _STATE["pieces"] = pieces
    return pieces


def _t_raw_join(ports: list[int], world: int) -> None:
    from megatron_areal.weights.wire import WeightUpdateGroup

    groups = _STATE["groups"]
    if groups.tp_rank == 0 and groups.dp_rank == 0:
        _STATE["raw"] = WeightUpdateGroup(master_address="127.0.0.1", master_port=ports[groups.pp_rank], rank=0,
                                          world_size=world, group_name=f"raw{groups.pp_rank}", timeout_s=300)


def _t_raw(pieces_per_stage: list[list[int]]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    raw, pieces = _STATE.get("raw"), pieces_per_stage[_STATE["groups"].pp_rank]
    if raw is not None:
        buffer = torch.ones(max(pieces), dtype=torch.uint8)
        for n in pieces:
            raw.broadcast(buffer[:n], src=0)
        raw.barrier()
    dist.barrier()
    return time.perf_counter() - start


def _t_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    _STATE.pop("sync").close()
    if "raw" in _STATE:
        _STATE.pop("raw").destroy()
    teardown_parallel()


# ---- the run -----------------------------------------------------------------------------------
def _wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.model.assets import make_tiny_model
    from megatron_areal.util.netutil import free_port

    root = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    model = make_tiny_model(root / "model", "llama", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_layers=args.layers, num_heads=8, num_kv_heads=4)
    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(2)]
    links = [(ctx.Queue(), ctx.Queue()) for _ in ports]
    servers = [ctx.Process(target=_server_main, args=(str(model), port, *q), daemon=True)
               for port, q in zip(ports, links, strict=True)]
    for s in servers:
        s.start()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    pool = WorkerPool(args.tp * args.pp, timeout_s=1800)
    try:
        for url in urls:
            _wait_healthy(url)
        pool.run(_t_setup, str(model), urls, args.bucket_mb, args.tp, args.pp)
        pool.run(_t_sync, "warmup")  # forms the groups
        _verify(urls, pool.run(_t_reference))
        recorded = pool.run(_t_record_pieces)
        # the raw arm: each stage's head broadcasts the bytes its stage's ranks sent, in the same pieces
        stage_of = [rank // (args.tp * (len(recorded) // (args.tp * args.pp))) for rank in range(len(recorded))]
        pieces = [[n for rank, sizes in enumerate(recorded) if stage_of[rank] == stage for n in sizes]
                  for stage in range(args.pp)]
        raw_ports = [free_port() for _ in range(args.pp)]
        world = 1 + len(servers)
        for stage in range(args.pp):
            for i, (inbox, _) in enumerate(links):
                inbox.put(("join", f"raw{stage}", {"master_address": "127.0.0.1", "master_port": raw_ports[stage],
                                                   "rank": 1 + i, "world_size": world, "timeout_s": 300}))
        pool.run(_t_raw_join, raw_ports, world)
        heads = {r["stage"]: rank for rank, r in enumerate(pool.run(_t_sync, "check")) if r["head"]}
        _acks(links, args.pp)
        _verify(urls, pool.run(_t_reference))
        syncs, raws = [], []
        for i in range(args.repeats):
            results = pool.run(_t_sync, str(i + 1))
            syncs.append(results)
            for stage in heads:
                for inbox, _ in links:
                    inbox.put(("recv", f"raw{stage}", {"pieces": pieces[stage]}))
            raws.append(max(pool.run(_t_raw, pieces)))
            _acks(links, args.pp)
        memory = pool.run(_t_sync, "memory", True)  # one more, untimed, to measure what a push holds
        _report(args, model, syncs, raws, memory, pieces)
    finally:
        try:
            pool.run(_t_close)
        finally:
            pool.close()
            for (inbox, _), s in zip(links, servers, strict=True):
                inbox.put(None)
                s.terminate()
                s.join(timeout=30)
            shutil.rmtree(root, ignore_errors=True)


def _acks(links: list[tuple[Any, Any]], stages: int) -> None:
    for _, outbox in links:
        for _ in range(stages):
            outbox.get(timeout=300)


def _verify(urls: list[str], references: list[dict[str, str]]) -> None:
    """Every server holds, bit for bit, the HF tensors the stage heads gather; exit 1 naming what differs."""
    import json
    import sys
    import urllib.request

    want = {name: sha for ref in references for name, sha in ref.items()}
    for url in urls:
        with urllib.request.urlopen(url + "/weights_checksum", timeout=120) as r:
            got = {n: v["sha256"] for n, v in json.loads(r.read())["checksums"].items()}
        wrong = sorted(n for n in want if got.get(n) != want[n])
        if wrong or not want:
            print(f"WRONG: {url} differs from the trainer's weights in {len(wrong)} of {len(want)} tensors: "
                  f"{wrong[:5]}", flush=True)
            sys.exit(1)


def _plan_rows(model: Path, tp: int, pp: int) -> float:
    """The transfer plan's busiest share for the bench's model and a Qwen3-MoE of its size (8 experts, EP2),
    servers at TP1 and TP2 (two of them); returns the dense one at TP2 servers (the RESULT)."""
    from megatron_areal.model.arch import ModelArch, load_arch
    from megatron_areal.weights.plan import ServerLayout, TrainerLayout, make_plan, stage_head_share

    dense = load_arch(model)
    moe = ModelArch(**{**dense.to_dict(), "model_type": "qwen3_moe", "qk_norm": True, "num_experts": 8,
                       "num_experts_per_tok": 2, "moe_intermediate_size": dense.hidden_size})
    models = {f"dense ({dense.model_type})": (dense, 1), "qwen3-moe EP2": (moe, 2)}
    print(f"transfer plan, trainer TP{tp} PP{pp}, two servers (busiest trainer rank's bytes / the mean):")
    result = 0.0
    for label, (arch, ep) in models.items():
        for server_tp in (1, 2):
            plan = make_plan(arch, TrainerLayout(tp, pp, 1, ep), ServerLayout(2, server_tp, sharded=server_tp > 1),
                             dtype_bytes=4)
            sent = plan.bytes_per_sender()
            share = plan.busiest_share()
            print(f"  {label:14s} servers TP{server_tp}: share {share:.3f} (stage heads: "
                  f"{stage_head_share(plan.trainer):.2f}), per rank MiB "
                  + " ".join(f"{n / 2**20:.1f}" for n in sent.values()))
            if label.startswith("dense") and server_tp == 2:
                result = share
    return result


def _report(args: argparse.Namespace, model: Path, syncs: list[list[dict[str, Any]]], raws: list[float],
            memory: list[dict[str, Any]], pieces: list[list[int]]) -> None:
    sync_s = statistics.median(max(r["seconds"] for r in results) for results in syncs)
    raw_s = statistics.median(raws)
    first = syncs[0]
    per_server = first[0]["bytes"]
    bucket = int(args.bucket_mb * 2**20)
    print(f"model: llama hidden={args.hidden} layers={args.layers}, trainer TP{args.tp} PP{args.pp}, "
          f"2 embedded servers (TP1), bucket {args.bucket_mb:g} MiB, {args.repeats} repeats (medians); "
          "weights verified on both servers")
    print(f"bytes per server:        {per_server / 2**20:10.1f} MiB in {sum(len(p) for p in pieces)} buckets "
          f"({per_server * 2 / 2**20:.1f} MiB sent in all)")
    print(f"seconds per sync:        {sync_s:10.3f}   ({per_server * 2 / sync_s / 2**20:.1f} MiB/s effective)")
    parts = [statistics.median(max(r["parts"][i] for r in results) for results in syncs) for i in range(3)]
    print(f"  busiest trainer rank:  {parts[0]:.3f} s convert+pack, {parts[1]:.3f} s waiting for the wire, "
          f"{parts[2]:.3f} s the whole push with the servers' installs")
    print(f"raw gloo broadcast:      {raw_s:10.3f}   ({per_server * 2 / raw_s / 2**20:.1f} MiB/s; stage heads, "
          "both stages at once)")
    wire = first[0]["wire"]
    if wire:
        print("bytes sent per trainer rank (MiB): " + " ".join(f"{n / 2**20:.1f}" for n in wire)
              + f"  -> measured busiest share {max(wire) / (sum(wire) / len(wire)):.3f} (servers TP1)")
    extra = max(r["extra_kb"] for r in memory) * 1024
    buffers = max(r["peak"] for r in memory)
    print(f"peak extra memory on any trainer rank: {extra / 2**20:.1f} MiB = {extra / bucket:.2f} buckets "
          f"(resident-set high-water mark of a sync that maps every block over 64 KiB on its own); the push's "
          f"bucket buffers {buffers / bucket:.2f} buckets")
    share = _plan_rows(model, args.tp, args.pp)
    print(f"RESULT weight_sync_vs_raw {raw_s / sync_s:.3f}")
    print(f"RESULT weight_push_busiest_share {share:.3f}")


if __name__ == "__main__":
    main()
