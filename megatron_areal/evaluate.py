"""Held-out accuracy: greedy answers from rollout servers, scored by the reward service.

``megatron-areal eval --model MODEL --task arithmetic-eval`` starts an embedded server on the
model (or uses ``--url``) and prints the accuracy; the trainer calls ``evaluate`` on its shared
``Fleet`` before, during and after a run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from megatron_areal.data.prompt import Prompt
from megatron_areal.data.template import encode_prompt
from megatron_areal.rollout.fleet import Fleet

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of prompts whose greedy answer scores reward >= 1
    n: int
    mean_response_tokens: float
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        return {"eval/accuracy": self.accuracy, "eval/response_tokens": self.mean_response_tokens}


async def _answer_all(fleet: Fleet, prompt_ids: list[list[int]], max_new_tokens: int, concurrency: int,
                      stop_token_ids: list[int]) -> list[list[int]]:
    clients = [slot.client for slot in fleet.routing.slots]  # every member, on the fleet's loop
    limit = asyncio.Semaphore(concurrency * len(clients))
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids}

    async def one(i: int, ids: list[int]) -> list[int]:
        async with limit:
            return (await clients[i % len(clients)].generate(ids, params)).output_ids

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))


def evaluate(fleet: Fleet, prompts: list[Prompt], tokenizer: Any, rewards: Any, *, max_new_tokens: int,
             chat_template: bool = True, concurrency: int = 64) -> EvalResult:
    """Greedy-decode every prompt on the fleet's members and score the replies with ``rewards``
    (a ``RewardService``). Call it from a plain thread (it waits on the fleet's loop)."""
    start = time.monotonic()
    prompt_ids = [encode_prompt(tokenizer, p, chat_template) for p in prompts]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    outputs = fleet.run(_answer_all(fleet, prompt_ids, max_new_tokens, concurrency, stop))
    correct = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        text = tokenizer.decode(out, skip_special_tokens=True)
        correct += rewards.score_sync(prompt.task, text, prompt.reward_answer()).reward >= 1.0
    n = len(prompts)
    return EvalResult(accuracy=correct / max(n, 1), n=n, mean_response_tokens=sum(map(len, outputs)) / max(n, 1),
                      seconds=time.monotonic() - start)


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

    from megatron_areal.assets import resolve_model
    from megatron_areal.data.tasks import load_task
    from megatron_areal.launch.embedded import start_embedded
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
