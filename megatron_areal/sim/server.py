"""One rollout server as the simulator sees it: continuous batching over a KV cache of fixed size.

Decoding advances every running sequence by one token per step. The server keeps only aggregate
state between events (batch size, total context, a heap of the step at which each sequence
finishes), so the cost of simulating a stretch of steps does not depend on its length.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from megatron_areal.sim.costs import CostModel, DecodeCost
from megatron_areal.sim.timeline import Timeline

# SGLang admits a request only if the cache can also hold a reserve of future tokens for every
# running request: ``new_token_ratio * max_new_tokens`` each, the ratio decaying to about 0.1 in
# steady state (``schedule_policy``: init 0.7 x min factor 0.14). When sequences outgrow the cache
# anyway it retracts the newest ones and re-prefills them later.
NEW_TOKEN_RATIO = 0.1
RETRACT_WATERMARK = 0.8  # on overflow, hand sequences back to the queue down to this share


@dataclass(eq=False)
class Group:
    gid: int
    start_version: int
    submit_time: float
    requests: list[Request] = field(default_factory=list)
    open: int = 0  # samples not finished yet
    finish_time: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.prompt + r.target for r in self.requests)

    @property
    def sq_sum(self) -> int:
        return sum((r.prompt + r.target) ** 2 for r in self.requests)


@dataclass(eq=False)
class Request:
    rid: int
    group: Group
    prompt: int
    target: int  # response tokens it will produce in total
    produced: int = 0
    joined_step: int = 0
    produced_at_join: int = 0
    versions: set[int] = field(default_factory=set)  # weight versions that produced its tokens

    @property
    def ctx(self) -> int:
        return self.prompt + self.produced


class SimServer:
    def __init__(self, idx: int, decode: DecodeCost, costs: CostModel, tp: int, kv_capacity: int,
                 max_running: int, max_new_tokens: int, timeline: Timeline) -> None:
        self.idx, self.name = idx, f"server{idx}"
        self.decode, self.costs, self.tp = decode, costs, tp
        self.kv_capacity, self.max_running = kv_capacity, max_running
        self.reserve = NEW_TOKEN_RATIO * max_new_tokens
        self.timeline = timeline
        self.clock = 0.0  # time at which the server's last scheduled work ends
        self.steps = 0  # decode steps done since start
        self.ctx = 0  # total context (prompt + produced) of the running batch
        self.running: list[tuple[int, int, Request]] = []  # heap (finish step, rid, request)
        self.queue: deque[Request] = deque()
        self.version = 0
        self.pending: int | None = None  # non-interruptible update waiting for the batch to drain
        self.epoch = 0  # bumps whenever a scheduled event of this server becomes stale
        self.tokens = 0  # tokens generated
        self.retracted = 0
        self._seq = itertools.count()

    @property
    def n(self) -> int:
        return len(self.running)

    @property
    def load(self) -> int:
        return self.n + len(self.queue)

    # ----- decoding

    def _sync_request(self, req: Request) -> None:
        req.produced = req.produced_at_join + (self.steps - req.joined_step)

    def steps_to_next_event(self) -> int | None:
        """Steps until a sequence finishes or the KV cache would overflow; None when idle."""
        if not self.running:
            return None
        k = self.running[0][0] - self.steps
        overflow = (self.kv_capacity - self.ctx) // self.n  # steps that still fit
        return max(0, overflow) if overflow < k and self.n > 1 else k

    def advance(self, k: int) -> list[Request]:
        """Run ``k`` decode steps from ``clock``; return the requests that finished."""
        if k <= 0 or not self.running:
            return self._pop_finished()
        t = self.decode.span_time(k, self.n, self.ctx)
        self.timeline.add(self.name, self.clock, self.clock + t, "decode")
        self.clock += t
        self.steps += k
        self.ctx += k * self.n
        self.tokens += k * self.n
        return self._pop_finished()

    def _pop_finished(self) -> list[Request]:
        done = []
        while self.running and self.running[0][0] <= self.steps:
            _, _, req = heapq.heappop(self.running)
            self._sync_request(req)
            self.ctx -= req.ctx
            done.append(req)
        return done

    def advance_past(self, t: float) -> list[Request]:
        """Bring the server to time ``t``: finish the step in flight at ``t`` (a pause or an
        admission takes effect between steps), or idle until ``t``."""
        if not self.running:
            self.clock = max(self.clock, t)
            return []
        if self.clock >= t:
            return []
        limit = self.steps_to_next_event()
        k = self.decode.steps_within(t - self.clock, self.n, self.ctx)
        if self.clock + self.decode.span_time(k, self.n, self.ctx) < t:
            k += 1
        return self.advance(min(k, limit if limit is not None else k))

    def retract_if_full(self) -> None:
        """The KV cache is full: hand the newest sequences back to the queue (SGLang retracts and
        later re-prefills them)."""
        if self.ctx + self.n <= self.kv_capacity:
            return
        newest = sorted(self.running, key=lambda e: -e[2].joined_step)
        keep_below = self.kv_capacity * RETRACT_WATERMARK
        for entry in newest:
            if self.ctx <= keep_below or self.n <= 1:
                break
            self.running.remove(entry)
            req = entry[2]
            self._sync_request(req)
            self.ctx -= req.ctx
            self.queue.appendleft(req)
            self.retracted += 1
        heapq.heapify(self.running)

    # ----- admission and prefill

    def admit(self) -> None:
        """Admit queued requests that fit and prefill them in one forward pass."""
        if self.pending is not None:
            return
        batch: list[Request] = []
        while self.queue and (self.max_running == 0 or self.n + len(batch) < self.max_running):
            req = self.queue[0]
            need = self.ctx + req.ctx + (self.n + len(batch) + 1) * self.reserve
            if need > self.kv_capacity and (self.running or batch):
                break
            self.queue.popleft()
            self.ctx += req.ctx
            batch.append(req)
        if batch:
            self._prefill(batch, shared_prompts=True)
            for req in batch:
                self._join(req)

    def _prefill(self, reqs: list[Request], shared_prompts: bool) -> None:
        """Fresh samples of one group share their prompt (radix cache): it is computed once."""
        tokens = sq = 0
        seen: set[int] = set()
        for r in reqs:
            if r.produced == 0 and shared_prompts:
                if r.group.gid in seen:
                    continue
                seen.add(r.group.gid)
            tokens += r.ctx
            sq += r.ctx * r.ctx
        t = self.costs.prefill_time(tokens, sq, self.tp)
        self.timeline.add(self.name, self.clock, self.clock + t, "prefill")
        self.clock += t

    def _join(self, req: Request) -> None:
        req.joined_step, req.produced_at_join = self.steps, req.produced
        req.versions.add(self.version)
        heapq.heappush(self.running, (self.steps + req.target - req.produced, next(self._seq), req))

    # ----- weight updates

    def load_weights(self, start: float, duration: float, version: int, interruptible: bool) -> None:
        """Receive new weights during [start, start + duration]. Interruptible: the running
        sequences keep their tokens, the KV cache is dropped and rebuilt by one prefill under the
        new weights, and decoding resumes."""
        self.timeline.add(self.name, start, start + duration, "update")
        self.clock = start + duration
        self.version = version
        self.pending = None
        if interruptible and self.running:
            reqs = [e[2] for e in self.running]
            for r in reqs:
                self._sync_request(r)
            self.running = []
            self._prefill(reqs, shared_prompts=False)
            for r in reqs:
                self._join(r)
