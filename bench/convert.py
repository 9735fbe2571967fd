"""SmolLM2-135M: HF -> Megatron distributed checkpoint at TP x PP -> HF, timed, with peak memory.

    python bench/convert.py [--tp 3 --pp 2] [--model smollm2-135m] [--workdir DIR]

SmolLM2-135M has 9 query and 3 KV heads, so its tensor-parallel sizes are 1, 3 and 9; the
default layout is TP3 PP2 (six ranks). Each direction runs in fresh spawned processes, so the
peak resident memory (ru_maxrss) printed is that direction's alone: per rank and summed over
ranks for hf-to-mcore, one process for mcore-to-hf. The round trip is then checked bitwise.
Last line: ``RESULT convert_roundtrip_s <seconds of both directions>``.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def to_hf_in_child(ckpt: str, out: str) -> tuple[float, float]:
    from megatron_areal.convert.convert import mcore_to_hf

    start = time.perf_counter()
    mcore_to_hf(ckpt, out)
    return time.perf_counter() - start, peak_rss_mb()


def bitwise_identical(a_dir: Path, b_dir: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the checkpoint and HF copy go (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from megatron_areal.convert.convert import hf_to_mcore
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.model.assets import resolve_model

    src = resolve_model(args.model)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    ckpt, back = work / "ckpt", work / "hf"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(back, ignore_errors=True)
    size_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
    print(f"model {src} ({size_mb:.0f} MB safetensors), layout tp={args.tp} pp={args.pp}")

    with WorkerPool(args.tp * args.pp, timeout_s=1800) as pool:
        pool.run(peak_rss_mb)  # processes started and imports done before the clock starts
        start = time.perf_counter()
        hf_to_mcore(src, ckpt, tp=args.tp, pp=args.pp, pool=pool)
        to_mcore_s = time.perf_counter() - start
        rank_peaks = pool.run(peak_rss_mb)
    ckpt_mb = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 2**20
    print(f"hf-to-mcore: {to_mcore_s:.2f} s, checkpoint {ckpt_mb:.0f} MB, peak RSS per rank "
          f"{', '.join(f'{m:.0f}' for m in rank_peaks)} MB (sum {sum(rank_peaks):.0f} MB), "
          f"driver {peak_rss_mb():.0f} MB")

    with WorkerPool(1) as pool:
        pool.run(peak_rss_mb)
        to_hf_s, to_hf_peak = pool.run(to_hf_in_child, str(ckpt), str(back))[0]
    print(f"mcore-to-hf: {to_hf_s:.2f} s, peak RSS {to_hf_peak:.0f} MB (one process, no model built)")
    identical = bitwise_identical(src, back)
    print(f"round trip bitwise identical: {identical}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    if not identical:  # a conversion that changes the weights has no time worth reporting
        raise SystemExit("convert: HF -> Megatron -> HF is not bitwise identical; no RESULT")
    print(f"RESULT convert_roundtrip_s {to_mcore_s + to_hf_s:.2f}")


if __name__ == "__main__":
    main()
