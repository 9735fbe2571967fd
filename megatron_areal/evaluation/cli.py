"""``megatron-areal eval --model MODEL --task arithmetic-eval``: held-out accuracy of a model.

Starts an embedded server on the model (or uses the servers given with ``--url``), answers every prompt
greedily (``megatron_areal/evaluation/held_out.py``) and prints the accuracy as one JSON line.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_areal.data.prompt import Prompt
from megatron_areal.evaluation.held_out import EvalResult, evaluate
from megatron_areal.fleet.fleet import Fleet


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-areal eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="HF folder or built-in model name")
    parser.add_argument("--task", default="arithmetic-eval", help="built-in task or JSONL file")
    parser.add_argument("--size", type=int, default=None, help="first N prompts only")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--url", action="append", default=[], help="use running servers instead of starting one")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--no-chat-template", action="store_true")
    args = parser.parse_args(argv)
    # imported once the arguments are known to be good: --help and a typo answer at once
    from transformers import AutoTokenizer

    from megatron_areal.data.tasks import load_task
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.model.assets import resolve_model
    from megatron_areal.reward import RewardConfig, RewardService

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = load_task(args.task, size=args.size)
    with RewardService(RewardConfig()) as rewards:
        if args.url:
            result = _evaluate_on(args.url, args.api_key, prompts, tokenizer, rewards, args)
        else:
            with start_embedded(model, threads=2) as server:
                result = _evaluate_on([server.url], None, prompts, tokenizer, rewards, args)
    print(json.dumps({"task": args.task, "model": str(model), "accuracy": result.accuracy, "n": result.n,
                      "mean_response_tokens": round(result.mean_response_tokens, 1),
                      "seconds": round(result.seconds, 1)}))
    return 0


def _evaluate_on(urls: list[str], api_key: str | None, prompts: list[Prompt], tokenizer: Any, rewards: Any,
                 args: argparse.Namespace) -> EvalResult:
    fleet = Fleet(urls, api_key=api_key)
    try:
        return evaluate(fleet, prompts, tokenizer, rewards, max_new_tokens=args.max_new_tokens,
                        chat_template=not args.no_chat_template)
    finally:
        fleet.close()
