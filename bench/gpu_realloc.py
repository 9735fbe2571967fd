"""The trainer side of the weight sync on one GPU: gather/convert/bucket against a plain device copy.

One process (world size 1: NCCL on CUDA, gloo otherwise) builds a Llama-shaped model with the
actor's ``build_model`` and streams it through ``weights.buckets.hf_buckets`` (HF conversion of
fused QKV / gate-up, vocabulary trim, packing into one reused flat bucket) on the device. Side by
side it measures a device-to-device copy of the same bytes in the same bucket-sized pieces, and
the peak extra device memory of the bucket stream against one bucket. Without CUDA it runs the
same code on the CPU at a small size, so the script itself is tested anywhere.

    python bench/gpu_realloc.py [--hidden 2048 --layers 16 --bucket-mb 512]

Last line: ``RESULT realloc_convert_vs_copy <ratio>`` (copy seconds / bucket-stream seconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stream(chunks: list, arch, groups, bucket_bytes: int, dtype: torch.dtype) -> tuple[float, int, int]:
    from megatron_areal.weights.buckets import hf_buckets

    _sync(groups.device)
    start, total, count = time.perf_counter(), 0, 0
    for bucket in hf_buckets(chunks, arch, groups, bucket_bytes=bucket_bytes, dtype=dtype,
                             device=groups.device):
        total += bucket.nbytes
        count += 1
    _sync(groups.device)
    return time.perf_counter() - start, total, count


def _copy(pieces: list[int], device: torch.device) -> float:
    src = torch.ones(max(pieces), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _sync(device)
    start = time.perf_counter()
    for n in pieces:
        dst[:n].copy_(src[:n])
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048 if on_gpu else 256)
    p.add_argument("--layers", type=int, default=16 if on_gpu else 4)
    p.add_argument("--vocab", type=int, default=32000 if on_gpu else 1024)
    p.add_argument("--bucket-mb", type=float, default=512.0 if on_gpu else 4.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29571"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)

    from megatron_areal.actor.model import build_model, te_available
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.model.arch import ModelArch

    groups = init_parallel(tp=1, pp=1, backend="nccl" if on_gpu else "gloo")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    h = args.hidden
    arch = ModelArch(model_type="llama", vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 11 // 4,
                     num_layers=args.layers, num_heads=h // 128, num_kv_heads=max(1, h // 512), head_dim=128,
                     max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                     qkv_bias=False, qk_norm=False, tie_word_embeddings=False)
    # the TE spec when TE imports, else the local one: the stream, not the spec, is measured here
    chunks = build_model(arch, groups, dtype=dtype, use_te=te_available())
    bucket = int(args.bucket_mb * 2**20)
    _stream(chunks, arch, groups, bucket, dtype)  # warm-up: allocator, kernels

    if on_gpu:
        torch.cuda.reset_peak_memory_stats(groups.device)
        base = torch.cuda.memory_allocated(groups.device)
    streams, total, count = [], 0, 0
    for _ in range(args.repeats):
        seconds, total, count = _stream(chunks, arch, groups, bucket, dtype)
        streams.append(seconds)
    extra = torch.cuda.max_memory_allocated(groups.device) - base if on_gpu else None
    pieces = [bucket] * (total // bucket) + ([total % bucket] if total % bucket else [])
    copies = [_copy(pieces, groups.device) for _ in range(args.repeats)]
    stream_s, copy_s = statistics.median(streams), statistics.median(copies)

    where = torch.cuda.get_device_name(0) if on_gpu else "CPU (no CUDA: small sizes, gloo)"
    print(f"device: {where}; llama hidden={h} layers={args.layers} vocab={args.vocab} {str(dtype)[6:]}, "
          f"bucket {args.bucket_mb:g} MiB, {args.repeats} repeats (medians)")
    print(f"HF bytes: {total / 2**20:.1f} MiB in {count} buckets")
    print(f"gather+convert+pack: {stream_s:.4f} s ({total / stream_s / 2**30:.2f} GiB/s)")
    print(f"device copy, same pieces: {copy_s:.4f} s ({total / copy_s / 2**30:.2f} GiB/s)")
    if extra is not None:
        print(f"peak extra device memory: {extra / 2**20:.1f} MiB = {extra / bucket:.2f} x one bucket")
    else:
        print("peak extra device memory: not measured without CUDA (see bench/weight_sync.py for CPU RSS)")
    print(f"RESULT realloc_convert_vs_copy {copy_s / stream_s:.3f}")


if __name__ == "__main__":
    main()
