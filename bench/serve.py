"""Output tokens/s: the embedded server vs transformers ``generate``, and vs vLLM's CPU build, on the
main job's rollouts.

The workload is the main job's: SmolLM2-135M-Instruct (fp32 on CPU), its arithmetic prompts through
the chat template, ``--samples`` samples per prompt at temperature 0.7, responses long-tailed, up
to ``--max-new-tokens``. Both sides run 32 sequences at a time, with the same threads:

- transformers: what a user writes, ``generate(do_sample=True, num_return_sequences=8)`` on 4
  prompts at a time (left-padded), until the longest of the 32 ends;
- the server: every sample sent as its own request at t=0, as the rollout loop sends a group, with
  ``--max-running 32``.

- vLLM (when its environment exists, ``scripts/install_vllm.sh``): the same requests to a vLLM CPU
  server started as the launcher starts it (``launch/vllm.py``: eager, float32), ``--max-num-seqs 32``,
  ``OMP_NUM_THREADS`` = ``--threads``: ``RESULT serve_vs_vllm`` is the embedded server's tokens/s over vLLM's.

Sampling is the same distribution on both sides (temperature only, no top-k/top-p), so response
lengths differ by chance, not by rule; useful tokens are counted up to and including EOS on both.
Both sides are warmed up the same way (one batch of 32 sequences, 8 tokens) before timing.

Before timing, greedy outputs and their logprobs are checked against transformers on a few prompts;
if they differ the bench exits with status 1 and prints no RESULT.

    python bench/serve.py [--prompts 8] [--samples 8] [--max-new-tokens 256] [--threads 2]
                          [--vllm-python .venv-vllm/bin/python | --vllm-python none]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_areal.data.arithmetic import arithmetic_train
from megatron_areal.data.template import encode_prompt
from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.vllm_client import VLLMClient
from megatron_areal.launch.embedded import start_embedded
from megatron_areal.launch.server_process import start_server, stop_server
from megatron_areal.launch.vllm import VLLMLaunch, launcher_command
from megatron_areal.model.assets import smollm2_path
from megatron_areal.util.netutil import free_port

BATCH = 32
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
TEMPERATURE = 0.7
CHECK_PROMPTS, CHECK_TOKENS = 3, 24


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of this process, or of process ``pid``: on a shared machine the
    steadier measure of the work each side does."""
    if pid is None:
        return time.process_time()
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` and its live descendants (vLLM computes in a child, its engine core)."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs if p.is_running())


def useful(ids: list[int], eos: set[int]) -> int:
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


class HF:
    """transformers ``generate``, as a user would call it."""

    def __init__(self, path, eos: set[int], pad: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos, self.pad = sorted(eos), pad

    def generate(self, prompts: list[list[int]], samples: int, max_new: int, **sampling) -> list[list[int]]:
        """Each prompt ``samples`` times, one left-padded batch; the generated ids of each row."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                      num_return_sequences=samples, eos_token_id=self.eos, pad_token_id=self.pad,
                                      **sampling)
        return [row[width:].tolist() for row in out]

    def logprobs(self, prompt: list[int], output: list[int]) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(self.model(torch.tensor([prompt + output])).logits[0].float(), -1)
        return [lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(output)]


SAMPLED = {"do_sample": True, "temperature": TEMPERATURE, "top_k": 0, "top_p": 1.0}


def run_hf(hf: HF, prompts: list[list[int]], samples: int, max_new: int) -> tuple[float, list[int]]:
    """Seconds and useful tokens per sequence, ``BATCH // samples`` prompts per generate call."""
    per_call = max(1, BATCH // samples)
    lengths: list[int] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), per_call):
        rows = hf.generate(prompts[i:i + per_call], samples, max_new, **SAMPLED)
        lengths += [useful(r, set(hf.eos)) for r in rows]
    return time.perf_counter() - start, lengths


async def server_outputs(client: RolloutClient, prompts: list[list[int]], samples: int,
                         params: dict) -> list[list[int]]:
    """Every sample its own request, all sent at once; output ids in prompt order."""
    jobs = [client.generate(p, params) for p in prompts for _ in range(samples)]
    return [r.output_ids for r in await asyncio.gather(*jobs)]


async def run_server(url: str, hf: HF, prompts: list[list[int]], samples: int,
                     max_new: int, client_class: type[RolloutClient] = RolloutClient) -> tuple[float, list[int]]:
    async with client_class(url, timeout_s=3600) as client:
        await server_outputs(client, prompts[:max(1, BATCH // samples)], samples,
                             {"max_new_tokens": 8, "temperature": TEMPERATURE})  # warm-up, as transformers'
        start = time.perf_counter()
        outs = await server_outputs(client, prompts, samples, {"max_new_tokens": max_new, "temperature": TEMPERATURE})
        return time.perf_counter() - start, [useful(o, set(hf.eos)) for o in outs]


async def check_greedy(url: str, hf: HF, prompts: list[list[int]],
                       client_class: type[RolloutClient] = RolloutClient) -> list[str]:
    """Greedy outputs and logprobs of the server against transformers; the differences found."""
    problems = []
    async with client_class(url, timeout_s=600) as client:
        got = await asyncio.gather(*(client.generate(p, {"max_new_tokens": CHECK_TOKENS, "temperature": 0})
                                     for p in prompts))
    for i, (p, res) in enumerate(zip(prompts, got, strict=True)):
        ref = hf.generate([p], 1, CHECK_TOKENS, do_sample=False)[0]
        ref = ref[:useful(ref, set(hf.eos))]
        if res.output_ids != ref:
            problems.append(f"prompt {i}: greedy tokens differ: server {res.output_ids} transformers {ref}")
            continue
        gap = max(abs(a - b) for a, b in zip(res.output_logprobs, hf.logprobs(p, ref), strict=True))
        if gap > 1e-3:
            problems.append(f"prompt {i}: logprobs differ from transformers' by up to {gap:.2e}")
    return problems


def pct(values: list[int], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (the main job's group size)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                   help="Python of the vLLM environment; 'none' skips the vLLM side")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server child on the way out
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from transformers import AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tok, q, use_chat_template=True) for q in arithmetic_train(seed=0, size=args.prompts)]
    eos = {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    hf = HF(path, eos, pad)
    torch.manual_seed(0)
    with start_embedded(path, args=["--max-running", str(BATCH), "--context-length", "1024",
                                    "--skip-tokenizer-init"], threads=args.threads, timeout_s=300) as srv:
        problems = asyncio.run(check_greedy(srv.url, hf, prompts[:CHECK_PROMPTS]))
        if problems:
            print("correctness check failed, no RESULT:\n  " + "\n  ".join(problems))
            sys.exit(1)
        per_call = max(1, BATCH // args.samples)
        hf.generate(prompts[:per_call], args.samples, 8, **SAMPLED)  # warm-up, as the server's
        load_before, cpu = os.getloadavg()[0], cpu_seconds()
        hf_s, hf_len = run_hf(hf, prompts, args.samples, args.max_new_tokens)
        hf_cpu = cpu_seconds() - cpu
        load_mid, cpu = os.getloadavg()[0], cpu_seconds(srv.proc.pid)
        sv_s, sv_len = asyncio.run(run_server(srv.url, hf, prompts, args.samples, args.max_new_tokens))
        sv_cpu = cpu_seconds(srv.proc.pid) - cpu
        load_after = os.getloadavg()[0]

    print(f"model {path.name}, {len(prompts)} prompts x {args.samples} samples (prompt {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), T {TEMPERATURE}, max_new_tokens {args.max_new_tokens}, "
          f"{args.threads} threads, {BATCH} sequences at a time")
    print(f"greedy check: {CHECK_PROMPTS} prompts x {CHECK_TOKENS} tokens equal transformers' (logprobs within 1e-3)")
    # The machine may be shared: the 1-minute load average shows how comparable the two phases were.
    print(f"load average: {load_before:.1f} before, {load_mid:.1f} between, {load_after:.1f} after "
          f"on {os.cpu_count()} CPUs")
    print(f"{'':24}{'tokens':>7}{'seconds':>9}{'tokens/s':>10}{'CPU s':>8}{'tokens/CPU s':>14}"
          f"   response length p50/p90/max")
    sides = (("transformers generate", hf_s, hf_cpu, hf_len), ("embedded server", sv_s, sv_cpu, sv_len))
    for name, s, cpu_s, lengths in sides:
        n = sum(lengths)
        print(f"{name:24}{n:>7}{s:>9.1f}{n / s:>10.1f}{cpu_s:>8.1f}{n / cpu_s:>14.1f}"
              f"   {pct(lengths, 50):.0f}/{pct(lengths, 90):.0f}/{max(lengths)}")
    print(f"tokens per CPU second, server over transformers: {(sum(sv_len) / sv_cpu) / (sum(hf_len) / hf_cpu):.2f}")
    print(f"RESULT serve_vs_hf {(sum(sv_len) / sv_s) / (sum(hf_len) / hf_s):.2f}")
    if args.vllm_python != "none" and Path(args.vllm_python).exists():
        vl_s, vl_cpu, vl_len = run_vllm(args.vllm_python, path, hf, prompts, args)
        n = sum(vl_len)
        print(f"{'vLLM CPU server':24}{n:>7}{vl_s:>9.1f}{n / vl_s:>10.1f}{vl_cpu:>8.1f}{n / vl_cpu:>14.1f}"
              f"   {pct(vl_len, 50):.0f}/{pct(vl_len, 90):.0f}/{max(vl_len)}   (load average {os.getloadavg()[0]:.1f})")
        print(f"RESULT serve_vs_vllm {(sum(sv_len) / sv_s) / (n / vl_s):.2f}")
    else:
        print(f"no vLLM environment at {args.vllm_python} (scripts/install_vllm.sh): no serve_vs_vllm")


def run_vllm(python: str, path: Path, hf: HF, prompts: list[list[int]],
             args: argparse.Namespace) -> tuple[float, float, list[int]]:
    """The same workload on a vLLM CPU server: greedy check, warm-up, timed run; seconds, CPU s, lengths."""
    import tempfile

    spec = VLLMLaunch(model_path=str(path), port=free_port(), python=python, context_length=1024,
                      max_running=BATCH, threads=args.threads, seed=0)
    log_path = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "server.log"
    proc = start_server(launcher_command(spec), spec.url, log_path, timeout_s=1200)
    try:
        problems = asyncio.run(check_greedy(spec.url, hf, prompts[:CHECK_PROMPTS], VLLMClient))
        if problems:
            print(f"vLLM correctness check failed (log {log_path}), no serve_vs_vllm:\n  " + "\n  ".join(problems))
            sys.exit(1)
        cpu = tree_cpu_seconds(proc.pid)
        seconds, lengths = asyncio.run(run_server(spec.url, hf, prompts, args.samples, args.max_new_tokens,
                                                  VLLMClient))
        return seconds, tree_cpu_seconds(proc.pid) - cpu, lengths
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
