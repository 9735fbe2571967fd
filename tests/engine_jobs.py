"""Submitting requests straight to an embedded ``Engine`` and collecting their answers (engine tests)."""
from __future__ import annotations

import threading

from megatron_areal.server.engine import Engine
from megatron_areal.server.sampler import SamplingParams
from megatron_areal.server.scheduler import Request


def run_jobs(engine: Engine, jobs: list[tuple[str, list[int], SamplingParams]],
             timeout: float = 120, record_routes: bool = False) -> dict[str, Request]:
    """Submit ``jobs`` (rid, prompt, params) and wait until every one is answered; {rid: request}.
    ``record_routes``: a MoE engine keeps each request's experts (``Request.routes``)."""
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_finish(r: Request) -> None:
        done[r.rid] = r
        if len(done) == len(jobs):
            finished.set()

    engine.submit(jobs, on_finish, record_routes=record_routes)
    assert finished.wait(timeout), f"never answered: {sorted({j[0] for j in jobs} - set(done))}"
    return done
