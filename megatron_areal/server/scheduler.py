"""Continuous batching: which requests prefill and decode at each step, and when they finish.

Pure bookkeeping, no tensors: the engine asks for a plan, runs the model and reports tokens back.
A request holds a KV slot from its prefill until it finishes, is aborted or is retracted (sent
back to the queue with its tokens so far, to be prefilled again, e.g. under new weights).

Requests that begin with the same tokens prefill them once: the samples of one prompt (the n
samples of a request, a group sent one by one) share all of it but its last token, and different
prompts share the chat template's common header. A request copies the longest prefix a running
request holds (``Plan.shares``) and computes only the rest; one whose longer prefix is being
prefilled in the same step waits a step for it. (A weight update retracts every running
request, so all KV in the slots is the current weights'.)
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_areal.server.routes import RouteLog
from megatron_areal.server.sampler import SamplingParams


@dataclass(eq=False)
class Request:
    """One sequence in the engine: prompt, sampling state, what it generated (with logprobs and weight
    versions), its KV slot and how much of it is cached."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    on_finish: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # leading tokens of all_ids whose KV is in the slot
    finish_reason: dict[str, Any] | None = None
    routes: RouteLog | None = None  # the experts each position was routed to, when asked for (MoE)
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output tokens so far."""
        return self.prompt_ids + self.output_ids


@dataclass
class Plan:
    """One engine step: requests to prefill, requests to decode, and prompt KV to copy between slots first."""

    prefill: list[Request]
    decode: list[Request]
    # (donor, request, n): the request starts from the first n positions of the running donor's KV
    shares: list[tuple[Request, Request, int]] = field(default_factory=list)


class Scheduler:
    """Continuous batching: which waiting requests start (slots and a prefill token budget permitting), which
    running ones decode, and when a request is finished."""

    def __init__(self, *, max_running: int, max_len: int, eos_ids: tuple[int, ...],
                 max_prefill_tokens: int = 8192, decode: Callable[[list[int]], str] | None = None) -> None:
        self.max_running, self.max_len = max_running, max_len
        self.eos_ids = frozenset(eos_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.decode = decode  # token ids -> text, for stop strings
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def plan(self, free_slots: int) -> Plan:
        """Admit queued requests in order while slots and the prefill token budget allow.

        Each starts from the longest prefix of its tokens that a running request holds; one whose
        longer prefix is being prefilled in this very plan waits a step for it, keeping its place in the
        queue and a slot (so that requests behind it do not take the slots its group needs to share).
        """
        plan = Plan(prefill=[], decode=list(self.running))
        if not self.waiting:
            return plan
        donors = {tuple(r.all_ids[:r.cached]): r for r in self.running if r.cached}
        prefilling: dict[tuple[int, ...], Request] = {}  # prompts this plan prefills, by their tokens
        kept: deque[Request] = deque()
        tokens = 0
        while self.waiting and len(plan.prefill) + len(kept) < free_slots:
            r = self.waiting.popleft()
            ids = r.all_ids
            donor, shared = longest_prefix(ids, donors)
            shared = min(shared, len(ids) - 1)  # the last token is computed: its logits sample the next
            if min(longest_prefix(ids, prefilling)[1], len(ids) - 1) > shared:
                kept.append(r)  # holds a slot: it is counted against free_slots above
                continue
            cost = len(ids) - shared
            if plan.prefill and tokens + cost > self.max_prefill_tokens:
                kept.append(r)
                break
            tokens += cost
            plan.prefill.append(r)
            if shared > 0:
                plan.shares.append((donor, r, shared))
            prefilling[tuple(r.prompt_ids)] = r
        kept.extend(self.waiting)
        self.waiting = kept
        return plan

    def append_token(self, req: Request, token: int, logprob: float, version: str) -> bool:
        """Record a generated token; returns True when the request is finished."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.output_versions.append(version)
        p = req.params
        n = len(req.output_ids)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        matched = self._stop_string(req) if p.stop and n >= p.min_new_tokens else None
        if token in stops and n >= p.min_new_tokens:
            req.finish_reason = {"type": "stop", "matched": token}
        elif matched is not None:
            req.finish_reason = {"type": "stop", "matched": matched}
        elif n >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": n}
        elif len(req.all_ids) >= self.max_len:
            req.finish_reason = {"type": "length", "length": n}
        return req.finish_reason is not None

    def _stop_string(self, req: Request) -> str | None:
        """A stop string that ends in the newest token (earlier matches ended the request already)."""
        if self.decode is None:
            return None
        longest = max(map(len, req.params.stop))
        # Each token decodes to at least one character, so this window holds any new match.
        window = req.output_ids[-(longest + 1):]
        text, before = self.decode(window), self.decode(window[:-1])
        for s in req.params.stop:
            if s in text and (s not in before or text.count(s) > before.count(s)):
                return s
        return None

    def take(self, predicate: Callable[[Request], bool]) -> list[Request]:
        """Remove and return matching requests, running and waiting."""
        taken = [r for r in self.running if predicate(r)] + [r for r in self.waiting if predicate(r)]
        self.running = [r for r in self.running if not predicate(r)]
        self.waiting = deque(r for r in self.waiting if not predicate(r))
        return taken

    def take_running(self) -> list[Request]:
        """Remove and return the running requests: those that hold a KV slot."""
        taken, self.running = self.running, []
        return taken

    def retract_all(self) -> list[Request]:
        """Send running requests back to the front of the queue, keeping their tokens."""
        retracted, self.running = self.running, []
        self.waiting.extendleft(reversed(retracted))
        return retracted


def common_prefix(a: list[int], b: list[int] | tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def longest_prefix(ids: list[int], donors: dict[tuple[int, ...], Request]) -> tuple[Request | None, int]:
    """The request whose tokens (the keys) share the longest prefix with ``ids``, and that length (0: none)."""
    best, length = None, 0
    for cached, donor in donors.items():
        n = common_prefix(ids, cached)
        if n > length:
            best, length = donor, n
    return best, length
