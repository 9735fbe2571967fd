"""``RUN_DIR/trained.jsonl``: which prompts each training step consumed, for audits of a run.

One line per step: ``{"step", "version", "prompts": [...], "staleness": [...], "rewards": [...]}``
(staleness and reward per trajectory, in batch order). On resume the
file is cut back to the checkpoint's step, so that after a crash and a restart the ledger
describes exactly the steps that the resumed model has been trained on: a prompt appears twice
only if the run really trained it twice (next epoch), and never vanishes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_areal.records import Trajectory
from megatron_areal.rundir.metrics import truncate_after


class TrainedLedger:
    def __init__(self, path: str | Path, resume_step: int) -> None:
        self.path = Path(path)
        truncate_after(self.path, resume_step)  # the same cut as metrics.jsonl and eval.jsonl
        self.path.touch()

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        path = Path(path)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def record(self, step: int, version: int, batch: list[Trajectory]) -> None:
        prompts = sorted({t.prompt_index for t in batch})
        staleness = [version - 1 - t.start_version for t in batch]
        rewards = [t.reward for t in batch]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "version": version, "prompts": prompts, "staleness": staleness,
                                "rewards": rewards}) + "\n")
            f.flush()
            os.fsync(f.fileno())
