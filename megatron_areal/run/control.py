"""Requests to a running trainer through files in ``RUN_DIR/control/`` (on the filesystem all nodes share).

A signal reaches only the process it is sent to: Slurm's pre-timeout ``SIGUSR1`` lands in the batch
step, which may be on another node than the trainer, behind ``srun``, a node agent and torchrun. A
file in the run directory reaches every trainer wherever it runs, so that is how requests travel:

- ``checkpoint``: save a checkpoint at the next step boundary, then stop (written on ``SIGUSR1`` by
  the Slurm batch step, or by the trainer itself when it receives ``SIGUSR1``). The trainer answers
  with ``saved`` (``{"step": N}``) once the checkpoint of step N is complete on every rank.
- ``hold``: hold the trainer at a step boundary until the file is removed: at the step written in it,
  or at the next boundary when it is empty. While holding, the trainer writes ``held``
  (``{"step": N}``) and still answers a ``checkpoint`` request. Operators use it to inspect or move a
  run at a known step; the Slurm tests use it to requeue a job at a step of their choosing instead of
  racing a job that trains faster than they can poll.
- ``resume``: written by the trainer itself when it saved a checkpoint and stopped on a failure that a
  fresh attempt can get past (a weight push lost over NCCL): ``{"step": N, "reason": ...}``. The
  Slurm batch step then requeues the job.

Rank 0 reads the files and broadcasts one decision per boundary, so every rank acts alike.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from megatron_areal.rundir.layout import RunDir

logger = logging.getLogger(__name__)

CHECKPOINT, SAVED, HOLD, HELD, RESUME = "checkpoint", "saved", "hold", "held", "resume"


def control_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).control


def _write(path: Path, info: dict) -> None:
    """Atomic, so that a reader on another node sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def request_checkpoint(run_dir: str | Path, reason: str) -> None:
    """Ask the trainer for a checkpoint at its next step boundary, then a stop."""
    _write(control_dir(run_dir) / CHECKPOINT, {"reason": reason, "time": time.time()})


def checkpoint_on_usr1(run_dir: str | Path, receiver: str) -> None:
    """Make SIGUSR1 to this process (``kill -USR1``, ``srun --signal=USR1@T``) ask the trainer for a
    checkpoint, as the Slurm batch step does, instead of dying of the signal's default action.
    ``receiver`` names this process in the request's reason."""
    def handler(_signum: int, _frame: FrameType | None) -> None:
        request_checkpoint(run_dir, f"SIGUSR1 to {receiver}")

    signal.signal(signal.SIGUSR1, handler)


def saved_step(run_dir: str | Path) -> int | None:
    """The step the trainer checkpointed and stopped at on request, if it did."""
    info = _read_json(control_dir(run_dir) / SAVED)
    return int(info["step"]) if info and "step" in info else None


def ask_to_resume(run_dir: str | Path, step: int, reason: str) -> None:
    """The trainer saved step ``step`` and stops on a failure a new attempt can get past."""
    _write(control_dir(run_dir) / RESUME, {"step": step, "reason": reason})


def resume_asked(run_dir: str | Path) -> dict | None:
    return _read_json(control_dir(run_dir) / RESUME)


def clear_requests(run_dir: str | Path) -> None:
    """Forget an earlier attempt's request and answers (a requeued job must not stop at once again).
    ``hold`` stays: whoever placed it removes it."""
    for name in (CHECKPOINT, SAVED, HELD, RESUME):
        (control_dir(run_dir) / name).unlink(missing_ok=True)


def hold_step(run_dir: str | Path) -> int | None | bool:
    """False: no hold. None: hold at the next boundary. N: hold at step N."""
    path = control_dir(run_dir) / HOLD
    try:
        text = path.read_text().strip()
    except OSError:
        return False
    try:
        return int(text) if text else None
    except ValueError:
        logger.warning("%s: %r is not a step number; holding at the next boundary", path, text)
        return None


def decide(run_dir: str | Path, step: int) -> str:
    """What rank 0 tells every rank at the boundary after ``step``: checkpoint, hold or go."""
    if (control_dir(run_dir) / CHECKPOINT).exists():
        return "checkpoint"
    hold = hold_step(run_dir)
    return "hold" if hold is None or (hold is not False and hold == step) else "go"


class StepControl:
    """The trainer's side: consult the control files at each step boundary."""

    def __init__(self, run_dir: str | Path, rank0: bool, agree: Callable[[str | None], str],
                 poll_s: float = 0.5) -> None:
        """``agree(decision)`` gives every rank rank 0's decision (a broadcast; rank 0 passes its own)."""
        self.run_dir, self.rank0, self.agree, self.poll_s = Path(run_dir), rank0, agree, poll_s

    def stop_after(self, step: int, save: Callable[[], None]) -> bool:
        """Called between steps. Holds while asked to; on a checkpoint request calls ``save()``, answers
        ``saved`` and returns True (the trainer stops). False: go on training."""
        held = False
        while True:
            action = self.agree(decide(self.run_dir, step) if self.rank0 else None)
            if action == "checkpoint":
                self._save_and_answer(step, save)
                return True
            if action == "go":
                if held:
                    self._note_released(step)
                return False
            if not held:
                held = True
                self._note_held(step)
            time.sleep(self.poll_s)

    def _save_and_answer(self, step: int, save: Callable[[], None]) -> None:
        save()
        if self.rank0:
            (control_dir(self.run_dir) / HELD).unlink(missing_ok=True)
            _write(control_dir(self.run_dir) / SAVED, {"step": step})
            logger.warning("checkpoint of step %d saved on request (%s); stopping so that the job can requeue",
                           step, control_dir(self.run_dir) / CHECKPOINT)

    def _note_held(self, step: int) -> None:
        if self.rank0:
            _write(control_dir(self.run_dir) / HELD, {"step": step})
            logger.info("holding after step %d until %s is removed", step, control_dir(self.run_dir) / HOLD)

    def _note_released(self, step: int) -> None:
        if self.rank0:
            (control_dir(self.run_dir) / HELD).unlink(missing_ok=True)
            logger.info("hold released after step %d", step)
