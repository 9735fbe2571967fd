"""The embedded server on an accelerator: output tokens/s at a given concurrency.

Called by ``bench/gpu_check.sh`` on machines with a GPU (not part of CI):

    python bench/gpu_server.py [--model HF_DIR] [--device cuda] [--requests 256] [--concurrency 64]

Requests are random-length sampled continuations (temperature 1, ``ignore_eos``) with
long-tailed ``max_new_tokens``, all issued at once; the last line is
``RESULT gpu_server_tokens_per_s <value>``.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from megatron_areal.fleet.client import RolloutClient
from megatron_areal.launch.embedded import start_embedded
from megatron_areal.model.assets import resolve_model, smollm2_path


async def drive(url: str, requests: int, max_new: int, vocab: int, seed: int) -> tuple[float, int, list[float]]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 128))]
        length = min(max_new, int(rng.lognormvariate(4.0, 1.0)) + 1)  # median ~55 tokens, long tail
        jobs.append((prompt, length))
    async with RolloutClient(url, timeout_s=3600) as client:
        await client.generate(jobs[0][0], {"max_new_tokens": 8, "ignore_eos": True})  # warm-up, kernels
        start = time.perf_counter()

        async def one(prompt: list[int], n: int) -> tuple[int, float]:
            res = await client.generate(prompt, {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0})
            return len(res.output_ids), time.perf_counter() - start

        results = await asyncio.gather(*(one(p, n) for p, n in jobs))
    return time.perf_counter() - start, sum(n for n, _ in results), [t for _, t in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or built-in name (default: SmolLM2-135M)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64, help="KV slots of the server (--max-running)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = resolve_model(args.model) if args.model else smollm2_path()
    from megatron_areal.model.arch import load_arch

    vocab = load_arch(path).vocab_size
    server_args = ["--device", args.device, "--max-running", str(args.concurrency), "--context-length", "1024",
                   "--skip-tokenizer-init"] + (["--dtype", args.dtype] if args.dtype else [])
    with start_embedded(path, args=server_args, timeout_s=600, threads=4) as srv:
        seconds, tokens, lat = asyncio.run(drive(srv.url, args.requests, args.max_new_tokens, vocab, args.seed))
    q = statistics.quantiles(lat, n=100, method="inclusive")
    print(f"model {path}, device {args.device}, {args.requests} requests, {args.concurrency} slots")
    print(f"output tokens {tokens} in {seconds:.1f}s; latency p50 {q[49]:.2f}s p99 {q[98]:.2f}s")
    print(f"RESULT gpu_server_tokens_per_s {tokens / seconds:.1f}")


if __name__ == "__main__":
    main()
