"""The reward pool: verifiers run in worker processes, off the generation path.

Each request borrows an idle worker, sends it the answer and waits at most ``timeout_s``. A
worker that overruns is killed and replaced before it is returned to the pool, so a reward that
hangs costs one worker restart and a 0 reward, counted in ``timeouts``; a verifier that raises
costs a 0 reward, counted in ``errors``. Neither ever reaches the caller as an exception.

The asyncio side (``score``) hands the blocking wait to a thread pool of the same size as the
process pool, so the rollout controller's event loop never blocks on a verifier.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_areal.reward.builtin import default_registry
from megatron_areal.reward.config import RewardConfig
from megatron_areal.reward.registry import VerifierRegistry
from megatron_areal.reward.worker import RewardResult, Worker
from megatron_areal.rundir import timeline

logger = logging.getLogger(__name__)


class RewardService:
    """``tasks``: the task names this run will score; their verifiers' preflight checks (the code
    sandbox: bubblewrap installed and working) run now, so a run on code tasks fails at start on a
    host without the sandbox, with an error naming the package. ``None`` (a caller that does not
    know its tasks yet): each task's check runs before its first answer is scored, so math and
    arithmetic need no sandbox, and a code answer raises the same error instead of scoring 0."""

    def __init__(self, config: RewardConfig, registry: VerifierRegistry | None = None,
                 tasks: Iterable[str] | None = None) -> None:
        config.validate()
        self.config = config
        self.registry = registry if registry is not None else default_registry(config)
        self._checked: set[str] = set()
        self._check_lock = threading.Lock()
        if tasks is not None:
            self._preflight(list(tasks))
        self._lock = threading.Lock()
        self._counts = {"scored": 0, "timeouts": 0, "errors": 0, "worker_restarts": 0}
        self._latency_sum = 0.0
        self._serial = 0
        self._closed = False
        self._idle: queue.Queue[Worker] = queue.Queue()
        workers = [self._spawn() for _ in range(config.workers)]
        for worker in workers:
            worker.wait_ready(config.worker_start_timeout_s)
            self._idle.put(worker)
        self._workers = set(workers)
        self._threads = ThreadPoolExecutor(config.workers, thread_name_prefix="reward")
        logger.info("reward service: %d workers, tasks %s", config.workers, ", ".join(self.registry.names()))

    def _spawn(self) -> Worker:
        with self._lock:
            self._serial += 1
            name = f"reward-worker-{self._serial}"
        return Worker(self.registry, name)

    def _replace(self, dead: Worker) -> Worker:
        fresh = self._spawn()
        fresh.wait_ready(self.config.worker_start_timeout_s)
        with self._lock:
            self._workers.discard(dead)
            self._workers.add(fresh)
            self._counts["worker_restarts"] += 1
        return fresh

    def score_sync(self, task: str, response_text: str, answer: Any) -> RewardResult:
        if self._closed:
            raise RuntimeError("the reward service is closed")
        self.registry.get(task)  # an unknown task is a configuration error: raise, do not score 0
        if task not in self._checked:
            self._preflight([task])
        worker = self._idle.get()
        try:
            result = worker.run((task, response_text, answer), self.config.timeout_s)
            timeline.record(worker.name, "scoring", result.elapsed_s)
            self._record(result)
            if result.status != "ok":
                logger.warning("reward %s for task '%s': %s", result.status, task, result.detail)
            if not worker.alive:  # killed after a timeout, or crashed: the pool keeps its size
                worker = self._replace(worker)
        finally:
            self._idle.put(worker)
        return result

    def _preflight(self, tasks: list[str]) -> None:
        """Run each task's host check once; a failed check raises and is retried on the next use."""
        with self._check_lock:
            todo = [t for t in tasks if t not in self._checked]
            self.registry.preflight(todo)
            self._checked.update(todo)

    async def score(self, task: str, response_text: str, answer: Any) -> RewardResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.score_sync, task, response_text, answer)

    def _record(self, result: RewardResult) -> None:
        key = {"ok": "scored", "timeout": "timeouts", "error": "errors"}[result.status]
        with self._lock:
            self._counts[key] += 1
            self._latency_sum += result.elapsed_s

    @property
    def scored(self) -> int:
        return self._counts["scored"]

    @property
    def timeouts(self) -> int:
        return self._counts["timeouts"]

    @property
    def errors(self) -> int:
        return self._counts["errors"]

    def metrics(self) -> dict[str, float]:
        """Cumulative counters for TensorBoard (``reward/...``)."""
        with self._lock:
            total = sum(self._counts[k] for k in ("scored", "timeouts", "errors"))
            out = {f"reward/{k}": float(v) for k, v in self._counts.items()}
            out["reward/latency_mean_s"] = self._latency_sum / total if total else 0.0
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.stop()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
