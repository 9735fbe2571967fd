"""The discrete-event run: a rollout controller with the real staleness gate, a fleet of
``SimServer``s and one trainer, advanced from event to event.

Events are a sequence finishing on a server (or its KV cache filling), the trainer finishing a
step, and a weight update completing. Between events nothing is simulated token by token; each
server's decode cost over a stretch of steps is closed-form (``costs.DecodeCost.span_time``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Callable

from megatron_areal.rollout.staleness import StalenessGate
from megatron_areal.sim.costs import CostModel, decode_cost
from megatron_areal.sim.push import update_time
from megatron_areal.sim.result import TRAINER, RunResult
from megatron_areal.sim.scenario import Scenario
from megatron_areal.sim.server import Group, Request, SimServer
from megatron_areal.sim.timeline import Timeline
from megatron_areal.sim.workload import LengthSampler

log = logging.getLogger(__name__)



class DeadlockError(RuntimeError):
    """No event is left but the run has not reached its last step."""


class Engine:
    """The discrete-event simulation of one cluster run (``Scenario``): rollout servers, trainer
    and weight pushes as events on one clock."""

    def __init__(self, sc: Scenario, record_timeline: bool = False) -> None:
        self.sc = sc
        self.costs = CostModel(sc.model, sc.gpu, sc.sim)
        # one weight update: the transfer plan's price on a GPU cluster (sim/push.py)
        self.update_s = update_time(sc)
        self.timeline = Timeline(enabled=record_timeline)
        dec = decode_cost(sc.model, sc.gpu, sc.server_tp, sc.sim)
        kv = self.costs.kv_capacity_tokens(sc.server_tp, sc.mem_fraction)
        self.servers = [SimServer(i, dec, self.costs, sc.server_tp, kv, sc.sim.max_running, sc.max_new_tokens,
                                  self.timeline)
                        for i in range(sc.n_servers)]
        self.gate = StalenessGate(eta=sc.eta, batch_size=sc.batch_size, max_concurrent=sc.max_concurrent)
        self.lengths = LengthSampler(sc.sim.prompt_mean_tokens, sc.sim.response_mean_tokens,
                                     sc.sim.response_sigma, sc.max_new_tokens, sc.sim.seed)
        self.now = 0.0
        self.events: list[tuple] = []
        self._seq = itertools.count()
        self._gid = itertools.count()
        self._rid = itertools.count()
        self.buffer: list[Group] = []
        self.trainer_busy = False
        self._discard = random.Random(sc.sim.seed + 1)  # its own stream: lengths stay as without discards
        self.result = RunResult(scenario=sc, timeline=self.timeline)

    # ----- event queue

    def _push(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _schedule(self, s: SimServer) -> None:
        s.epoch += 1
        k = s.steps_to_next_event()
        if k is not None:
            self._push(s.clock + s.decode.span_time(k, s.n, s.ctx), "server", s.idx, s.epoch, s.steps + k)

    # ----- servers

    def _touch(self, s: SimServer) -> None:
        """Bring ``s`` to now, act on what finished, admit what fits, and reschedule."""
        done = s.advance_past(self.now)
        self._after_decode(s, done)

    def _after_decode(self, s: SimServer, done: list[Request]) -> None:
        s.retract_if_full()
        if s.pending is not None and not s.running:  # drained: a non-interruptible update loads now
            start = max(s.clock, self.now)
            s.load_weights(start, self.update_s,
                           s.pending, interruptible=False)
        s.admit()
        self._schedule(s)
        self._finish(done)

    def _on_server_event(self, idx: int, epoch: int, target: int) -> None:
        s = self.servers[idx]
        if epoch != s.epoch:
            return
        self._after_decode(s, s.advance(target - s.steps))

    # ----- controller

    def _fill(self) -> None:
        """Submit as many groups as the staleness gate allows."""
        while self.gate.try_submit():
            g = Group(gid=next(self._gid), start_version=self.gate.version, submit_time=self.now)
            prompt = self.lengths.prompt()
            for _ in range(self.sc.group_size):
                g.requests.append(Request(rid=next(self._rid), group=g, prompt=prompt,
                                          target=self.lengths.response()))
            g.open = len(g.requests)
            s = min(self.servers, key=lambda x: (x.pending is not None, x.load, x.idx))
            s.queue.extend(g.requests)
            self.result.submitted += 1
            self._touch(s)

    def _finish(self, done: list[Request]) -> None:
        for req in done:
            g = req.group
            g.open -= 1
            if g.open == 0:
                g.finish_time = self.now
                if self._discard.random() < self.sc.discard_fraction:  # all-equal rewards: filtered out
                    self.gate.on_reject()
                    self.result.discarded += 1
                    continue
                self.gate.on_accept()
                self.buffer.append(g)
        if done:
            self._try_train()
            self._fill()

    # ----- trainer

    def _try_train(self) -> None:
        if self.trainer_busy:
            return
        version = self.gate.version
        stale = [g for g in self.buffer if version - g.start_version > self.sc.eta]
        if stale:
            self.buffer = [g for g in self.buffer if g not in stale]
            self.gate.on_drop(len(stale))
            self.result.dropped += len(stale)
        if len(self.buffer) < self.sc.batch_size:
            return
        self.buffer.sort(key=lambda g: (g.start_version, g.finish_time))
        batch, self.buffer = self.buffer[: self.sc.batch_size], self.buffer[self.sc.batch_size:]
        tokens = sum(g.tokens for g in batch)
        sc = self.sc
        t = self.costs.train_time(tokens, sum(g.sq_sum for g in batch), sc.train_gpus, sc.train_tp,
                                  sc.train_pp, sc.n_minibatches, sc.max_tokens_per_mb, ep=sc.train_ep,
                                  etp=sc.train_etp, gpus_per_node=sc.gpus_per_node)
        self.result.alltoall_bytes_per_gpu += self.costs.alltoall_bytes_per_gpu(
            tokens, sc.train_gpus, sc.train_ep, sc.n_minibatches)
        self.trainer_busy = True
        self.timeline.add(TRAINER, self.now, self.now + t, "train")
        self.result.record_batch(version, batch, tokens)
        self._push(self.now + t, "train_done")

    def _on_train_done(self) -> None:
        """Push the new weights. Interruptible: every server pauses after its current step and
        receives them at once (one collective). Otherwise each server loads them once drained."""
        new = self.gate.version + 1
        xfer = self.update_s
        if not self.sc.interruptible:
            self.timeline.add(TRAINER, self.now, self.now + xfer, "send")
            self._push(self.now + xfer, "update_done", new)
            return
        finished = [(s, s.advance_past(self.now)) for s in self.servers]
        start = max([self.now] + [s.clock for s in self.servers])
        self.timeline.add(TRAINER, self.now, start + xfer, "send")
        for s, _ in finished:
            s.load_weights(start, xfer, new, interruptible=True)
        self._push(start + xfer, "update_done", new)
        for s, done in finished:
            self._after_decode(s, done)

    def _on_update_done(self, version: int) -> None:
        if not self.sc.interruptible:  # published: each server loads it once its batch drains
            for s in self.servers:
                s.pending = version
                self._touch(s)
        self.gate.on_version(version)
        self.trainer_busy = False
        self.result.step_end(self.now, self.servers, self.timeline)
        self._fill()
        self._try_train()

    # ----- main loop

    def run(self, progress: Callable[[int], None] | None = None) -> RunResult:
        self._fill()
        while self.gate.version < self.sc.sim.steps:
            if not self.events:
                raise DeadlockError(f"{self.sc.label}: no events left at version {self.gate.version}, "
                                    f"gate {self.gate.counts()}, buffer {len(self.buffer)}")
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = max(self.now, t)
            if kind == "server":
                self._on_server_event(*payload)
            elif kind == "train_done":
                self._on_train_done()
            else:
                self._on_update_done(*payload)
                if progress:
                    progress(self.gate.version)
        c = self.gate.counts()
        self.result.finalize(running=c.running, buffered=len(self.buffer), servers=self.servers)
        return self.result


def simulate(sc: Scenario, record_timeline: bool = False,
             progress: Callable[[int], None] | None = None) -> RunResult:
    return Engine(sc, record_timeline).run(progress)
