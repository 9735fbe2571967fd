"""``megatron-areal score``: per-token logprobs of given token sequences under the Megatron model.

    megatron-areal score (--ckpt CKPT_DIR | --hf HF_DIR) --input SEQS.jsonl --output OUT.jsonl
                         [--tp N --pp N --ep N --etp N --temperature T]

SEQS.jsonl holds ``{"input_ids": [...]}`` per line; OUT.jsonl gets ``{"logprobs": [...]}`` per
line, one float per token after the first (token t given tokens < t). The logprobs come from the
actor's own forward path (packed micro-batches through Megatron's pipeline schedule and the
vocabulary-parallel log-softmax), so comparing them with what a rollout server reported shows
the train/inference mismatch. ``--ep``/``--etp`` split a MoE model's experts over expert-parallel
and expert-tensor-parallel ranks; the job runs ``pp * lcm(tp, ep * etp)`` ranks.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from megatron_areal.checkpoint import dist_ckpt
from megatron_areal.convert.cli import INPUT_ERRORS
from megatron_areal.convert.spawn import WorkerPool
from megatron_areal.model.arch import ModelArch, load_arch
from megatron_areal.model.hf_io import HFReader

log = logging.getLogger(__name__)


class InputFileError(ValueError):
    """A malformed line of the sequences file; the message names file and line."""


def read_sequences(path: str | Path, vocab_size: int) -> list[list[int]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such input file")
    sequences = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["input_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputFileError(f"{path}:{lineno}: expected {{\"input_ids\": [...]}} ({e})") from None
        if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(t, int) for t in ids):
            raise InputFileError(f"{path}:{lineno}: input_ids must be a list of at least 2 integers")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputFileError(f"{path}:{lineno}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        sequences.append(ids)
    return sequences


def write_logprobs(path: str | Path, logprobs: list[list[float]]) -> None:
    """Write OUT.jsonl through a temporary file, so a failure never leaves a partial output."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for row in logprobs:
            f.write(json.dumps({"logprobs": row}) + "\n")
    os.replace(tmp, path)


def resolve_source(hf: str | None, ckpt: str | None) -> tuple[str, Path, ModelArch]:
    """("hf" | "ckpt", path, arch), validating the source in the calling process."""
    if ckpt:
        path = Path(ckpt)
        arch = dist_ckpt.hf_arch_from_ckpt(path)
        dist_ckpt.check_same_model(path, arch)
        return "ckpt", path, arch
    from megatron_areal.model.assets import resolve_model

    path = resolve_model(hf)
    arch = load_arch(path)
    HFReader(path, arch)  # fail here, naming the file, rather than on every rank
    return "hf", path, arch


def score_rank(kind: str, source: str, sequences: list[list[int]], tp: int, pp: int, temperature: float = 1.0,
               max_tokens_per_mb: int = 4096, ep: int = 1, etp: int = 1) -> list[list[float]]:
    """One rank of ``score`` (inside a worker pool): logprobs of every sequence, on every rank."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.weights import load_hf_weights

    arch = dist_ckpt.hf_arch_from_ckpt(Path(source)) if kind == "ckpt" else load_arch(source)
    groups = init_parallel(tp=tp, pp=pp, backend="gloo", ep=ep, etp=etp)
    try:
        longest = max(len(s) for s in sequences)
        lora = dist_ckpt.read_meta(source).get("lora") if kind == "ckpt" else None  # a model.lora run's adapters
        actor = Actor(arch, ModelConfig(path=source, dtype="float32", max_seq_len=longest,
                                        lora=LoraConfig(**lora) if lora else LoraConfig()),
                      ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, max_tokens_per_mb=max(max_tokens_per_mb, longest),
                                     sequence_parallel=arch.is_moe and tp > 1),
                      OptimizerConfig(distributed=False), PPOConfig(), groups, total_steps=1)
        if kind == "ckpt":
            dist_ckpt.load_model(actor.model, source, arch)
        else:
            load_hf_weights(actor.model, source, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer,
                            etp_rank=groups.etp_rank, etp_size=groups.etp)
        return [lp.tolist() for lp in actor.compute_logprobs(sequences, temperature)]
    finally:
        teardown_parallel()


def score(kind: str, source: Path, sequences: list[list[int]], tp: int = 1, pp: int = 1,
          temperature: float = 1.0, pool: WorkerPool | None = None, ep: int = 1, etp: int = 1) -> list[list[float]]:
    """Logprobs of ``sequences``; a given ``pool`` may be larger than the layout needs (spare ranks are DP)."""
    from megatron_areal.actor.parallel import min_world

    own_pool = pool is None
    pool = pool or WorkerPool(min_world(tp, pp, ep, etp))
    try:
        return pool.run(score_rank, kind, str(source), sequences, tp, pp, temperature, ep=ep, etp=etp)[0]
    finally:
        if own_pool:
            pool.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-areal score", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="Megatron checkpoint directory (conversion or training)")
    source.add_argument("--hf", help="HF model folder (or a built-in model name)")
    parser.add_argument("--input", required=True, help='JSONL, {"input_ids": [...]} per line')
    parser.add_argument("--output", required=True, help='JSONL to write, {"logprobs": [...]} per line')
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE models)")
    parser.add_argument("--temperature", type=float, default=1.0, help="logprobs of softmax(logits / T)")
    args = parser.parse_args(argv)
    start = time.time()
    try:
        kind, path, arch = resolve_source(args.hf, args.ckpt)
        from megatron_areal.actor.model import check_layout

        check_layout(arch, args.tp, args.pp, args.ep, args.etp)
        sequences = read_sequences(args.input, arch.vocab_size)
        if not sequences:
            raise InputFileError(f"{args.input}: no sequences")
        logprobs = score(kind, path, sequences, args.tp, args.pp, args.temperature, ep=args.ep, etp=args.etp)
        write_logprobs(args.output, logprobs)
    except (*INPUT_ERRORS, InputFileError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokens = sum(len(s) for s in sequences)
    print(json.dumps({"sequences": len(sequences), "tokens": tokens, "output": args.output,
                      "seconds": round(time.time() - start, 2)}))
    return 0
