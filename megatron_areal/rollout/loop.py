"""The asynchronous core of the rollout controller: everything here runs on one event loop.

Submission: a group (``group_size`` samples of one prompt, sent as separate requests so each
can be routed and interrupted on its own) starts only when ``StalenessGate.try_submit`` grants a
slot, checked again for every group. Finished groups are scored and offered to the buffer; the
gate learns the outcome (accept / reject / drop), which may open capacity again.

Weight updates: ``pause`` stops new segments and pauses every server, which returns in-flight
requests with what they have; ``resume(v)`` publishes version ``v`` and lets the interrupted
samples continue under the new weights. When the weight mover pauses the servers itself, the
loop still works without being told: aborted segments are re-posted at once, the servers hold
them until they continue, and the versions come from the servers' answers either way.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from collections.abc import Callable
from typing import Any

from megatron_areal.fleet.client import ServerError
from megatron_areal.fleet.routing import ServerPool, ServerSlot
from megatron_areal.fleet.wakeup import Signal
from megatron_areal.records import Group, Trajectory
from megatron_areal.rollout.buffer import PutResult, ReplayBuffer
from megatron_areal.rollout.config import RolloutConfig
from megatron_areal.rollout.metrics import ThroughputWindow, batch_stats
from megatron_areal.rollout.refusals import RefusalWatch
from megatron_areal.rollout.request import SampleError, SampleOutput, VersionParser, generate_sample
from megatron_areal.rollout.sources import EpisodesLike, PromptLike, PromptSourceLike, ScorerLike
from megatron_areal.rollout.staleness import StalenessGate
from megatron_areal.rundir import timeline

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """The rollout loop cannot deliver a batch (timeout, exhausted data, an internal failure)."""


class RolloutLoop:
    """The rollout controller's core, on its asyncio loop: keeps up to the staleness gate's
    capacity of groups in flight on the fleet, scores finished samples, and fills the replay
    buffer the trainer takes batches from. ``RolloutController`` is its thread-safe front."""

    def __init__(self, cfg: RolloutConfig, eta: int, prompts: PromptSourceLike,
                 encode: Callable[[PromptLike], list[int]], decode: Callable[[list[int]], str],
                 scorer: ScorerLike, *, version: int = 0, episodes: EpisodesLike | None = None) -> None:
        self.cfg, self.eta = cfg, eta
        self.prompts, self.encode, self.decode, self.scorer = prompts, encode, decode, scorer
        self.episodes = episodes  # agent episodes (rollout.workflow) instead of single completions
        self.version = version
        self.gate = StalenessGate(eta, cfg.batch_size, cfg.max_concurrent, version)
        self.buffer = ReplayBuffer(eta, cfg.filter_equal_rewards)
        self.pool: ServerPool | None = None
        self.counters = collections.Counter[str]()
        self.last_batch: dict[str, float] = {}
        # a server's launch label ("default") means the weights it was started with: the run's base
        # model, version 0, also after a resume at version > 0 (a restarted server is not current)
        self._parse_version = VersionParser(0)
        self._inflight: dict[int, PromptLike] = {}  # group id -> prompt, in submission order
        self._next_gid = 0
        self._run_id = uuid.uuid4().hex[:8]  # request ids stay unique across restarts
        self._exhausted = False
        self._error: BaseException | None = None
        # twice what can be in flight: a refusal streak that long is the run's state, not a few bad prompts
        self._refusals = RefusalWatch(max(16, 2 * cfg.max_concurrent))
        self._tasks: set[asyncio.Task[Any]] = set()
        self._window: ThroughputWindow | None = None
        self._running: asyncio.Event | None = None
        self._changed: Signal | None = None

    # ----- lifecycle (on the loop)

    async def start(self, pool: ServerPool) -> None:
        """Route over ``pool`` (a ``Fleet``'s members, which the fleet keeps and closes)."""
        self._running, self._changed = asyncio.Event(), Signal()
        self._running.set()
        self._window = ThroughputWindow()
        self.pool = pool
        self._spawn(self._submit_loop(), "submit")
        self._spawn(self._health_loop(), "health")

    async def close(self) -> None:
        """Cancel the loop's tasks and ask the healthy servers to abort what they were generating for it."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.episodes is not None:
            await self.episodes.close()
        if self.pool is not None:
            # Our requests are gone; stop the servers from finishing them for nobody.
            await asyncio.gather(*(s.client.abort_all() for s in self.pool.healthy()), return_exceptions=True)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            log.error("rollout task %s failed: %r", task.get_name(), self._error)
            self._changed.notify()

    # ----- submission

    async def _submit_loop(self) -> None:
        while True:
            timeline.set_state(timeline.ROLLOUT_LOOP, self._waiting_for())
            await self._running.wait()
            if self._exhausted or self.gate.capacity() < 1:
                await self._changed.wait()
                continue
            try:
                prompt = next(self.prompts)
            except StopIteration:
                self._exhausted = True
                log.info("prompt stream exhausted; %d groups still running", self.gate.counts().running)
                self._changed.notify()
                continue
            if not self.gate.try_submit():  # single-threaded, so only a bookkeeping bug gets here
                raise RuntimeError("gate refused a submission its capacity allowed")
            gid, self._next_gid = self._next_gid, self._next_gid + 1
            self._inflight[gid] = prompt
            self._spawn(self._run_group(gid, prompt, self.version), f"group-{gid}")

    def _waiting_for(self) -> str:
        """What submission waits for next (the run's timeline): nothing, a pause, the staleness gate or the
        concurrency limit, or no more prompts."""
        if not self._running.is_set():
            return "paused"
        if self._exhausted:
            return "prompts exhausted"
        if self.gate.capacity() >= 1:
            return "submitting"
        return "at concurrency limit" if self.gate.counts().running >= self.cfg.max_concurrent else "at staleness gate"

    async def _run_group(self, gid: int, prompt: PromptLike, version: int) -> None:
        group = None
        try:
            group = await self._generate_group(gid, prompt, version)
        except* SampleError as failed:  # the request itself is bad: skip the group, keep running
            log.error("group %d (prompt %d) failed and is skipped: %s",
                      gid, prompt.index, failed.exceptions[0])
            self.counters["sample_failures"] += 1
            reason = self._refusals.refused(failed.exceptions[0])
            if reason is not None and self._error is None:
                self._error = RolloutError(f"every request of the last {self._refusals.limit} groups was refused "
                                           f"for the same reason; the run cannot train: {reason}")
        if group is not None:
            self._refusals.succeeded()
        self._finish(gid, group)

    async def _generate_group(self, gid: int, prompt: PromptLike, version: int) -> Group:
        if self.episodes is not None:
            return await self._generate_episodes(gid, prompt, version)
        prompt_ids = self.encode(prompt)
        sampling = {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": self.cfg.top_k}
        async with asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(generate_sample(
                self.pool, prompt_ids, sampling, self.cfg.max_new_tokens, f"{self._run_id}-{gid}-{i}",
                self._running.wait, self._parse_version, is_paused=lambda: not self._running.is_set(),
                on_tokens=self._window.add_tokens, return_routed_experts=self.cfg.return_routed_experts))
                for i in range(self.cfg.group_size)]
        trajectories = [self._trajectory(gid, prompt, prompt_ids, job.result(), version) for job in jobs]
        rewards = await asyncio.gather(*(
            self.scorer.score(prompt.task, self.decode(t.output_ids), t.answer) for t in trajectories))
        for traj, result in zip(trajectories, rewards):
            traj.reward = float(result.reward)
            if result.status != "ok":
                self.counters["reward_failures"] += 1
        return Group(group_id=gid, prompt_index=prompt.index, trajectories=trajectories)

    async def _generate_episodes(self, gid: int, prompt: PromptLike, version: int) -> Group:
        """``group_size`` agent episodes of ``prompt``: each of their completions is generated like a sample
        (routed, interruptible, per-token versions); the agents score the episodes themselves."""
        sampling = {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": self.cfg.top_k}

        async def generate(prompt_ids: list[int], max_new_tokens: int, key: str) -> SampleOutput:
            return await generate_sample(
                self.pool, prompt_ids, sampling, max_new_tokens, f"{self._run_id}-{gid}-{key}", self._running.wait,
                self._parse_version, is_paused=lambda: not self._running.is_set(), on_tokens=self._window.add_tokens)

        trajectories = await self.episodes.run_group(gid, prompt, version, generate, self.cfg.group_size)
        if not trajectories:
            raise SampleError(f"no episode of group {gid} generated a token")
        return Group(group_id=gid, prompt_index=prompt.index, trajectories=trajectories)

    def _trajectory(self, gid: int, prompt: PromptLike, prompt_ids: list[int], s: SampleOutput,
                    version: int) -> Trajectory:
        oldest = min(s.output_versions, default=version)
        if oldest < version:
            # A server still on older weights than the gate assumed: its tokens make the sample
            # older, and the buffer must judge it by the oldest policy that contributed.
            log.warning("group %d: tokens from version %d although started at %d", gid, oldest, version)
        return Trajectory(prompt_ids=list(prompt_ids), output_ids=s.output_ids,
                          output_logprobs=s.output_logprobs, output_versions=s.output_versions,
                          routed_experts=s.routed_experts,
                          start_version=min(version, oldest), group_id=gid,
                          prompt_index=prompt.index, answer=prompt.reward_answer(), task=prompt.task,
                          finish_reason=s.finish_reason, interruptions=s.interruptions)

    def _finish(self, gid: int, group: Group | None) -> None:
        """Settle a group that left flight: into the buffer (accept) or not (reject)."""
        del self._inflight[gid]
        outcome = self.buffer.put(group, self.version) if group is not None else None
        if outcome is PutResult.ACCEPTED:
            self.gate.on_accept()
        else:
            self.gate.on_reject()
        if outcome is PutResult.STALE:
            self._log_dropped([group])
        self._changed.notify()

    def _log_dropped(self, groups: list[Group]) -> None:
        for g in groups:
            log.info("dropped stale group %d (prompt %d): started at version %d, now %d, eta %d",
                     g.group_id, g.prompt_index, g.start_version, self.version, self.eta)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for slot in await self.pool.probe_down():
                if await self._holds_current_weights(slot):
                    self.pool.mark_up(slot)
                    if self._running.is_set():  # it may have missed a continue while it was down
                        try:
                            await slot.client.resume()
                        except ServerError as e:
                            self.pool.mark_down(slot, f"continue after recovery failed: {e}")

    async def _holds_current_weights(self, slot: ServerSlot) -> bool:
        """A server that comes back (say, restarted) must not serve an old policy unnoticed: it
        rejoins only once it reports the current version (after the next weight sync)."""
        try:
            label = await slot.client.weight_version()
        except ServerError as e:
            slot.last_error = str(e)
            return False
        if self._parse_version(label) == self.version:
            return True
        reason = f"answers again but holds weights version {label!r}, current is {self.version}"
        if slot.last_error != reason:
            log.warning("rollout server %s %s: kept out until it is updated", slot.url, reason)
            slot.last_error = reason
        return False

    # ----- trainer-facing operations (called through the controller thread bridge)

    async def take_batch(self, timeout: float) -> list[Trajectory]:
        """The oldest ``batch_size`` admissible groups' trajectories once the buffer holds them (stale
        groups are dropped first); raises ``RolloutError`` on timeout, saying what is missing, or when
        the prompts run out."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if self._error is not None:
                raise RolloutError(f"rollout loop failed: {self._error!r}") from self._error
            batch, dropped = self.buffer.take(self.version, self.cfg.batch_size)
            if dropped:
                self._log_dropped(dropped)
                self.gate.on_drop(len(dropped))
                self._changed.notify()
            if batch is not None:
                trajectories = [t for g in batch for t in g.trajectories]
                self.last_batch = batch_stats(trajectories, self.version)
                return trajectories
            if self._exhausted and not self._inflight:
                raise RolloutError(f"prompt stream exhausted with only {len(self.buffer)} of "
                                   f"{self.cfg.batch_size} groups buffered")
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RolloutError(self._shortfall(timeout))
            await self._changed.wait(remaining)

    def _shortfall(self, timeout: float) -> str:
        c = self.gate.counts()
        down = self.pool.down_urls()
        ready = self.buffer.count_admissible(self.version)
        return (f"get_batch timed out after {timeout:.0f}s: {ready} of {self.cfg.batch_size} admissible "
                f"groups buffered at version {self.version} (eta {self.eta}); "
                f"{c.running} groups running, capacity {self.gate.capacity()}, "
                f"paused={not self._running.is_set()}, dropped stale {self.buffer.dropped_stale}, "
                f"filtered {self.buffer.filtered}, failed {self.counters['sample_failures']}; "
                f"servers down {len(down)}/{len(self.pool.slots)}"
                + (f" ({', '.join(down)})" if down else ""))

    async def pause(self, pause_servers: bool = True) -> None:
        """Stop submitting; with ``pause_servers`` also pause every healthy server (a server that fails to
        pause is marked down)."""
        self._running.clear()
        timeline.set_state(timeline.ROLLOUT_LOOP, "paused")
        if not pause_servers:  # the weight mover pauses them itself
            return
        slots = self.pool.healthy()
        results = await asyncio.gather(*(s.client.pause() for s in slots), return_exceptions=True)
        for slot, r in zip(slots, results):
            if isinstance(r, Exception):
                self.pool.mark_down(slot, f"pause failed: {r}")

    async def resume(self, version: int, resume_servers: bool = True) -> None:
        """Move to ``version``, continue the servers (unless the weight path did), and submit again."""
        self.set_version(version)
        if resume_servers:
            slots = self.pool.healthy()
            results = await asyncio.gather(*(s.client.resume() for s in slots), return_exceptions=True)
            for slot, r in zip(slots, results):
                if isinstance(r, Exception):
                    self.pool.mark_down(slot, f"continue failed: {r}")
        self._running.set()
        self._changed.notify()

    def set_version(self, version: int) -> None:
        """Move to ``version`` and drop the buffered groups it makes too old."""
        self.gate.on_version(version)
        self.version = version
        dropped = self.buffer.drop_stale(version)
        if dropped:
            self._log_dropped(dropped)
            self.gate.on_drop(len(dropped))
        if self._changed is not None:
            self._changed.notify()

    def metrics(self) -> dict[str, float]:
        """The last batch's statistics, the gate's and buffer's counts, failures, server health and the
        throughput since the last call."""
        c = self.gate.counts()
        stats = dict(self.last_batch)
        stats.update({
            "rollout/dropped_stale": float(self.buffer.dropped_stale),
            "rollout/filtered_groups": float(self.buffer.filtered),
            "rollout/reward_failures": float(self.counters["reward_failures"]),
            "rollout/sample_failures": float(self.counters["sample_failures"]),
            "rollout/request_failures": float(sum(slot.failures for slot in self.pool.slots)),
            "rollout/running_groups": float(c.running),
            "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/capacity": float(self.gate.capacity()),
            "rollout/version": float(self.version),
            "rollout/healthy_servers": float(len(self.pool.healthy())),
            "rollout/server_restarts": float(self.pool.added),  # dropped, then re-admitted
            "rollout/servers_dropped": float(self.pool.removed),
        })
        stats.update(self._window.roll(self.pool.busy_seconds(), len(self.pool.slots)))
        if self.episodes is not None:
            stats.update(self.episodes.metrics())
        return stats

    # ----- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """A consistent snapshot: groups in flight are recorded as prompts to re-queue."""
        return {"version": self.version, "gate": self.gate.state_dict(), "buffer": self.buffer.state_dict(),
                "prompts": self.prompts.state_dict(), "requeue": [p.index for p in self._inflight.values()],
                "next_group_id": self._next_gid}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` before start: the groups in flight at save time come out of the prompt
        stream again first."""
        if self._inflight:
            raise RolloutError("load_state_dict while groups are in flight; restore before start()")
        self.prompts.load_state_dict(state["prompts"])
        self.prompts.push_back(list(state["requeue"]))
        self.gate.load_state_dict(state["gate"])
        self.buffer.load_state_dict(state["buffer"])
        self.version = int(state["version"])
        self._next_gid = int(state["next_group_id"])
