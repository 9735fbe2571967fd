"""Output tokens/s: the embedded server (continuous batching) vs transformers ``generate`` at batch 32.

Same model (SmolLM2-135M-Instruct, fp32 on CPU), same chat prompts, greedy decoding until EOS or
``--max-new-tokens``. The prompts mix "just the number" questions with "explain" questions, so
output lengths are long-tailed, as in RL rollouts. Both sides use the same threads and the same
concurrency (32). All requests are issued at t=0; a request's latency is the time until its
output is complete (for ``generate``: until its padded batch of 32 finishes).

Useful tokens are counted up to and including EOS on both sides.

    python bench/serve.py [--prompts 64] [--max-new-tokens 192] [--threads 2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

import torch

from megatron_areal.assets import smollm2_path
from megatron_areal.rollout.client import RolloutClient
from megatron_areal.server.local import start_embedded

BATCH = 32


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        if i % 4 == 3:
            ask = f"Explain step by step how to compute {a} {op} {b}, then give the result."
        elif i % 4 == 2:
            ask = f"Write a short story about the number {a}."
        else:
            ask = f"What is {a} {op} {b}? Answer with just the number."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    return [list(p) for p in prompts]


def useful(ids: list[int], eos: set[int]) -> int:
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


def run_hf(path, prompts: list[list[int]], max_new: int, eos: set[int], pad: int) -> tuple[float, int, list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, latencies = 0, []
    start = time.perf_counter()
    for i in range(0, len(prompts), BATCH):
        batch = prompts[i:i + BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=pad)
        done = time.perf_counter() - start
        tokens += sum(useful(row[width:].tolist(), eos) for row in out)
        latencies += [done] * len(batch)
    return time.perf_counter() - start, tokens, latencies


async def run_server(url: str, prompts: list[list[int]], max_new: int) -> tuple[float, int, list[float]]:
    async with RolloutClient(url, timeout_s=3600) as client:
        await client.generate(prompts[0], {"max_new_tokens": 4, "temperature": 0})  # warm-up
        start = time.perf_counter()

        async def one(p: list[int]) -> tuple[int, float]:
            res = await client.generate(p, {"max_new_tokens": max_new, "temperature": 0})
            return len(res.output_ids), time.perf_counter() - start

        results = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, sum(n for n, _ in results), [t for _, t in results]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from transformers import AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tok, args.prompts)
    eos = {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    load_before = os.getloadavg()[0]
    hf_s, hf_tokens, hf_lat = run_hf(path, prompts, args.max_new_tokens, eos, pad)
    load_mid = os.getloadavg()[0]
    with start_embedded(path, args=["--max-running", str(BATCH), "--context-length", "1024",
                                    "--skip-tokenizer-init"], threads=args.threads, timeout_s=300) as srv:
        sv_s, sv_tokens, sv_lat = asyncio.run(run_server(srv.url, prompts, args.max_new_tokens))
    load_after = os.getloadavg()[0]

    print(f"model {path.name}, {len(prompts)} prompts, greedy, max_new_tokens {args.max_new_tokens}, "
          f"{args.threads} threads, concurrency {BATCH}")
    # The machine may be shared: the 1-minute load average shows how comparable the two phases were.
    print(f"load average: {load_before:.1f} before, {load_mid:.1f} between, {load_after:.1f} after "
          f"on {os.cpu_count()} CPUs")
    print(f"{'':28}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'p50 s':>8}{'p99 s':>8}")
    for name, s, n, lat in (("transformers generate (b32)", hf_s, hf_tokens, hf_lat),
                            ("embedded server", sv_s, sv_tokens, sv_lat)):
        print(f"{name:28}{n:>8}{s:>10.1f}{n / s:>10.1f}{pct(lat, 50):>8.1f}{pct(lat, 99):>8.1f}")
    ratio = (sv_tokens / sv_s) / (hf_tokens / hf_s)
    print(f"RESULT serve_vs_hf {ratio:.2f}")


if __name__ == "__main__":
    main()
