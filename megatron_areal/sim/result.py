"""What a simulated run measured: step end times, staleness of every trained group, tokens,
busy time per side, and the counts that must balance (conservation of groups)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_areal.sim.timeline import Timeline

if TYPE_CHECKING:
    from megatron_areal.sim.scenario import Scenario
    from megatron_areal.sim.server import Group, SimServer

TRAINER = "trainer"


@dataclass
class Snapshot:
    time: float
    gen_tokens: int  # generated so far, all servers
    trained_tokens: int
    gen_busy: float  # server-seconds busy so far
    train_busy: float


@dataclass(eq=False)
class RunResult:
    scenario: Scenario
    timeline: Timeline
    submitted: int = 0
    trained: int = 0
    dropped: int = 0
    discarded: int = 0  # finished but filtered out (Scenario.discard_fraction)
    running: int = 0
    buffered: int = 0
    trained_tokens: int = 0
    staleness: Counter = field(default_factory=Counter)  # train version - start version, per group
    steady_staleness: Counter = field(default_factory=Counter)  # the same, after warm-up only
    versions_per_sample: Counter = field(default_factory=Counter)  # weight versions in one sample
    snapshots: list[Snapshot] = field(default_factory=list)
    retracted: int = 0
    alltoall_bytes_per_gpu: float = 0.0  # MoE: expert all-to-all each trainer GPU sent, all steps

    # ----- recording (called by the engine)

    def record_batch(self, version: int, batch: list[Group], tokens: int) -> None:
        self.trained += len(batch)
        self.trained_tokens += tokens
        steady = version >= self.scenario.sim.warmup_steps
        for g in batch:
            self.staleness[version - g.start_version] += 1
            if steady:
                self.steady_staleness[version - g.start_version] += 1
            for r in g.requests:
                self.versions_per_sample[len(r.versions)] += 1

    def step_end(self, now: float, servers: list[SimServer], timeline: Timeline) -> None:
        gen_busy = sum(timeline.busy[s.name] for s in servers)
        self.snapshots.append(Snapshot(now, sum(s.tokens for s in servers), self.trained_tokens,
                                       gen_busy, timeline.busy[TRAINER]))

    def finalize(self, running: int, buffered: int, servers: list[SimServer]) -> None:
        self.running, self.buffered = running, buffered
        self.retracted = sum(s.retracted for s in servers)

    # ----- derived figures over the steady window (after warm-up)

    @property
    def step_times(self) -> list[float]:
        t = [0.0] + [s.time for s in self.snapshots]
        return [b - a for a, b in zip(t, t[1:])]

    def _window(self) -> tuple[Snapshot, Snapshot, int]:
        w = self.scenario.sim.warmup_steps
        first = self.snapshots[w - 1] if w > 0 else Snapshot(0.0, 0, 0, 0.0, 0.0)
        return first, self.snapshots[-1], len(self.snapshots) - w

    @property
    def step_time(self) -> float:
        a, b, n = self._window()
        return (b.time - a.time) / n

    @property
    def gen_tokens_per_s(self) -> float:
        a, b, _ = self._window()
        return (b.gen_tokens - a.gen_tokens) / (b.time - a.time)

    @property
    def train_tokens_per_s(self) -> float:
        a, b, _ = self._window()
        return (b.trained_tokens - a.trained_tokens) / (b.time - a.time)

    @property
    def gen_utilisation(self) -> float:
        """Share of server time spent decoding, prefilling or loading weights."""
        a, b, _ = self._window()
        return min(1.0, (b.gen_busy - a.gen_busy) / ((b.time - a.time) * self.scenario.n_servers))

    @property
    def train_utilisation(self) -> float:
        a, b, _ = self._window()
        return min(1.0, (b.train_busy - a.train_busy) / (b.time - a.time))

    @property
    def max_staleness(self) -> int:
        return max(self.staleness) if self.staleness else 0

    def staleness_mean(self, steady: bool = True) -> float:
        counts = self.steady_staleness if steady else self.staleness
        total = sum(counts.values())
        return sum(k * v for k, v in counts.items()) / total if total else 0.0
