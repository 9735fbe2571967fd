"""The launcher's view of its trainer ranks' heartbeats (written by ``trainer/exit.py``)."""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from megatron_areal.rundir.layout import heartbeat_path


class TrainerHeartbeats:
    """The heartbeat files of this node's trainer ranks (``trainer/exit.py``): ``stuck()`` names a rank whose
    file has not been touched for ``timeout_s`` (a rank not yet started has none and counts as live)."""

    def __init__(self, run_root: Path, ranks: Iterable[int], timeout_s: float) -> None:
        self.paths = [heartbeat_path(run_root, r) for r in ranks]
        self.timeout_s = timeout_s
        for p in self.paths:  # an earlier attempt's file must not count
            p.unlink(missing_ok=True)

    def stuck(self) -> str | None:
        now = time.time()
        for p in self.paths:
            try:
                age = now - p.stat().st_mtime
            except OSError:
                continue
            if age > self.timeout_s:
                return (f"trainer {p.name.replace('trainer-', '')} has shown no heartbeat for {age:.0f} s "
                        f"(cluster.progress_timeout_s {self.timeout_s:.0f}): its main work ended or it is frozen")
        return None
