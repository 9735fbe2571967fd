"""Resume leaves no traces of the abandoned run.

After a kill between checkpoints and a resume from checkpoint step S: ``metrics.jsonl``,
``eval.jsonl``, ``trained.jsonl`` and TensorBoard hold each step once (what the abandoned run
logged after S is dropped); the resumed run still has its "before" accuracy for the closing
summary; and a rollout server restarted with its launch weights (label ``"default"``) is not
taken for current by a controller at version > 0.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web
from rollout_fakes import FakeFleet, FakeServer, ListPrompts, ParityScorer, decode, encode

from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.routing import ServerSlot
from megatron_areal.rollout.config import RolloutConfig
from megatron_areal.rollout.loop import RolloutLoop
from megatron_areal.rundir.ledger import TrainedLedger
from megatron_areal.rundir.metrics import MetricsWriter, append_eval, read_eval, truncate_after


def _steps(path: Path) -> list[int | str]:
    out: list[int | str] = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            out.append("torn")
    return out


def _abandoned_run(run_dir: Path, last: int) -> None:
    """What a run killed after logging step ``last`` leaves: a before eval at 0, steps 1..last,
    evals every 2 steps, and a line torn by the kill at the end of metrics.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    w = MetricsWriter(run_dir, total_steps=10, tensorboard=False, progress=False)
    append_eval(run_dir, {"step": 0, "label": "before", "accuracy": 0.25, "n": 8})
    for step in range(1, last + 1):
        w.advance(step, {"train/loss": 1.0 / step})
        if step % 2 == 0:
            append_eval(run_dir, {"step": step, "label": "during", "accuracy": 0.5, "n": 8})
    w.close()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(f'{{"step": {last + 1}, "train/lo')


def test_resume_drops_metrics_and_evals_after_the_checkpoint(tmp_path):
    _abandoned_run(tmp_path, last=6)
    w = MetricsWriter(tmp_path, total_steps=10, start_step=3, tensorboard=False, progress=False)
    w.advance(4, {"train/loss": 0.2})
    w.close()
    append_eval(tmp_path, {"step": 4, "label": "during", "accuracy": 0.75, "n": 8})
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    assert _steps(tmp_path / "eval.jsonl") == [0, 2, 4]
    assert not list(tmp_path.glob("*.tmp"))


def test_fresh_start_at_step_0_starts_the_logs_afresh(tmp_path):
    _abandoned_run(tmp_path, last=2)  # killed before its first checkpoint
    MetricsWriter(tmp_path, total_steps=10, start_step=0, tensorboard=False, progress=False).close()
    assert _steps(tmp_path / "metrics.jsonl") == []
    assert _steps(tmp_path / "eval.jsonl") == []  # the before eval runs again


def test_tensorboard_purges_steps_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path, total_steps=10, progress=False)
    for step in range(1, 7):
        w.log(step, {"train/loss": float(step)})
    w.close()
    w = MetricsWriter(tmp_path, total_steps=10, start_step=3, progress=False)
    for step in range(4, 6):
        w.log(step, {"train/loss": 10.0 * step})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_ledger_uses_the_same_cut_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "trained.jsonl"
    lines = [json.dumps({"step": s, "version": s, "prompts": [s], "staleness": [0]}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "vers')
    TrainedLedger(path, resume_step=3)
    assert [r["step"] for r in TrainedLedger.read(path)] == [1, 2, 3]
    TrainedLedger(tmp_path / "new.jsonl", resume_step=0)
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_truncate_after_keeps_records_at_or_before_the_step(tmp_path):
    path = tmp_path / "x.jsonl"
    truncate_after(path, 3)  # no file: nothing to do
    assert not path.exists()
    path.write_text('{"step": 1}\n\n{"step": 3, "a": 1}\n{"step": 4}\nnot json\n{"nostep": 1}\n')
    truncate_after(path, 3)
    assert path.read_text() == '{"step": 1}\n{"step": 3, "a": 1}\n'


def test_resumed_run_reads_back_its_before_accuracy(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megatron_areal.trainer import rank0

    _abandoned_run(tmp_path, last=4)
    duties = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(run_dir=str(tmp_path))))
    calls = []
    monkeypatch.setattr(rank0, "evaluate_held_out", lambda *a: calls.append(a) or 0.5)
    assert rank0.before_accuracy(duties, 3) == 0.25  # resumed: read back, not re-evaluated
    assert calls == []
    assert rank0.before_accuracy(duties, 0) == 0.5  # a run at step 0 evaluates
    assert len(calls) == 1 and calls[0][-1] == "before"
    assert read_eval(tmp_path / "missing", "before") is None


class LaunchLabelServer(FakeServer):
    """A freshly (re)started server that was never updated: it reports its launch label."""

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "default"})


def _loop(version: int) -> RolloutLoop:
    return RolloutLoop(RolloutConfig(batch_size=4, group_size=2, max_new_tokens=8), 1, ListPrompts(10),
                       encode, decode, ParityScorer(), version=version)


def _holds(loop: RolloutLoop, url: str) -> bool:
    async def check() -> bool:
        client = RolloutClient(url, timeout_s=10)
        try:
            return await loop._holds_current_weights(ServerSlot(client))
        finally:
            await client.close()

    return asyncio.run(check())


def test_restarted_server_on_base_weights_is_not_current_after_a_resume():
    fleet = FakeFleet([LaunchLabelServer(seed=0), FakeServer(seed=1, version=3)])
    base, updated = fleet.urls
    try:
        assert _holds(_loop(0), base)  # a run that has not trained: the base is current
        resumed = _loop(3)  # the trainer passes the checkpoint's version
        assert not _holds(resumed, base)
        assert _holds(resumed, updated)
        assert resumed._parse_version("default") == 0  # its samples read as base-weights samples
        restored = _loop(0)  # the controller's own resume path
        restored.load_state_dict(resumed.state_dict())
        assert restored.version == 3 and not _holds(restored, base)
    finally:
        fleet.close()
