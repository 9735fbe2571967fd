"""The launcher's watch on its running servers: one that stops answering for a bound is killed, named.

A server process can stay alive and serve nothing (its event loop stuck, the process frozen); the keeper
(``launch/procs.ServerKeeper``) restarts only processes that exit. A daemon thread asks each server's
``/run_identity`` (which answers at once, paused or not, and needs no key: ``util/run_identity.py``) every
``interval_s``; ``stalled()`` names a server that has given no answer for ``timeout_s`` since its last
answer (a restarted one first gets ``startup_s`` to load), and the launcher kills it, so the keeper
restarts it or gives it up, and the run never waits on it without a bound.
"""
from __future__ import annotations

import threading
import time

from megatron_areal.launch.procs import ServerKeeper
from megatron_areal.run.plan import ServerSlot
from megatron_areal.util.run_identity import identity_problem


class ServerWatch:
    def __init__(self, keeper: ServerKeeper, slots: dict[str, ServerSlot], nonce: str, timeout_s: float,
                 startup_s: float, interval_s: float = 5.0) -> None:
        self.keeper, self.slots, self.nonce = keeper, slots, nonce
        self.timeout_s, self.startup_s, self.interval_s = timeout_s, startup_s, interval_s
        now = time.monotonic()
        # child name -> (pid, when it must have answered by); the servers were admitted just now
        self._due = {name: (keeper.servers[name].pid, now + timeout_s) for name in slots}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_forever, name="server-watch", daemon=True)

    def start(self) -> ServerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _probe_forever(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, slot in self.slots.items():
                child = self.keeper.servers[name]
                if child.returncode() is None and identity_problem(slot.url, self.nonce, self.interval_s) is None:
                    with self._lock:
                        self._due[name] = (child.pid, time.monotonic() + self.timeout_s)

    def stalled(self) -> list[tuple[str, str]]:
        """(child name, why) of each running server silent for longer than the bound."""
        out = []
        now = time.monotonic()
        with self._lock:
            for name, slot in self.slots.items():
                child = self.keeper.servers[name]
                pid, due = self._due[name]
                if pid != child.pid:  # restarted since: it first loads its model
                    self._due[name] = (child.pid, now + self.startup_s)
                    continue
                if child.returncode() is None and now > due:
                    out.append((name, f"server {slot.id} (pid {child.pid}, {slot.url}) has not answered for over "
                                      f"{self.timeout_s:.0f} s (cluster.progress_timeout_s)"))
                    self._due[name] = (child.pid, now + self.startup_s)  # one kill per silence
        return out
