"""Held-out accuracy: greedy answers from rollout servers, scored by the reward service.

The trainer calls ``evaluate`` on its shared ``Fleet`` before, during and after a run;
``megatron-areal eval`` (``evaluation/cli.py``) calls it on servers it starts or is given.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from megatron_areal.data.prompt import Prompt
from megatron_areal.data.template import encode_prompt
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.rundir import timeline

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
        client = clients[i % len(clients)]
        async with limit:
            with timeline.activity(timeline.server_role(client.url), "evaluating"):
                return (await client.generate(ids, params)).output_ids

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
