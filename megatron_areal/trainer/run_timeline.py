"""The main job's timeline (``megatron_areal.rundir.timeline``) as trainer rank 0 records it.

The run begins when the launcher wrote the plan (``plan.json``'s modification time), so the servers'
start-up before the trainer process existed is on the record: the trainer is "launching servers"
until its process starts, each server "starting up" until its registration file appears.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_areal.run.registry import read_registrations
from megatron_areal.rundir import timeline
from megatron_areal.rundir.layout import RunDir
from megatron_areal.rundir.timeline import SERVER_PRIORITY, Timeline

logger = logging.getLogger(__name__)

TRAINER = "trainer"
EVALUATION = "held-out evaluation"
# A plan older than this was written by an earlier attempt or a queued batch job: the run begins now.
MAX_LAUNCH_S = 1800.0


def begin(plan: Path) -> Timeline:
    """Install the run's timeline, its origin when ``plan`` was written (else now)."""
    try:
        ago = time.time() - plan.stat().st_mtime
    except OSError:
        ago = 0.0
    if not 0.0 <= ago <= MAX_LAUNCH_S:
        ago = 0.0
    tl = Timeline(origin=time.monotonic() - ago)
    tl.add_role(TRAINER, "waiting for servers", at=0.0, first=("launching servers", tl.now()))
    timeline.install(tl)
    return tl


def servers_ready(registrations: Path, urls: list[str]) -> None:
    """Start each server's role: "starting up" until its registration file was written, then idle."""
    tl = timeline.current()
    if tl is None:
        return
    files = {url: registrations / name for name, url in read_registrations(registrations).items()}
    for url in urls:
        try:
            ready = tl.now() - (time.time() - files[url.rstrip("/")].stat().st_mtime)
        except (KeyError, OSError):
            ready = tl.now()
        tl.add_role(timeline.server_role(url), "idle", at=0.0, priority=SERVER_PRIORITY, first=("starting up", ready))


def finish(run_dir: RunDir) -> None:
    """Write the timeline and its summary into the run directory (rank 0; nothing elsewhere)."""
    tl = timeline.current()
    if tl is None:
        return
    try:
        timeline.write(tl, run_dir.timeline, run_dir.timeline_summary)
    except OSError as e:  # the run's result matters more than its timeline
        logger.warning("could not write the timeline into %s: %s", run_dir.root, e)
    finally:
        timeline.install(None)
