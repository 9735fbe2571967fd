"""Weight-update groups formed at the same time in one process (``weights/wire.py``).

A process that joins two groups at once (a server receiving two pipeline stages, the bench's raw
receiver joining one group per stage) must not hold a process-wide lock while a group connects: the
other members may be waiting in the other group, for this process. Here two member processes join
groups g0 and g1 in opposite orders while this process hosts rank 0 of both; each join must end within
its timeout.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from netutil import free_ports

MEMBER = """
import sys, threading, time
from megatron_areal.weights.wire import WeightUpdateGroup
port0, port1, rank, first = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
order = [("g0", port0), ("g1", port1)] if first == "g0" else [("g1", port1), ("g0", port0)]
errors = []
def join(name, port):
    try:
        g = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=rank, world_size=3,
                              group_name=name, timeout_s=20)
        g.barrier()
    except Exception as e:
        errors.append(f"{name}: {e}")
threads = []
for name, port in order:
    threads.append(threading.Thread(target=join, args=(name, port)))
    threads[-1].start()
    time.sleep(1.0)  # the first group is connecting when the second starts
for t in threads:
    t.join()
print("ERRORS" if errors else "JOINED", errors, flush=True)
sys.exit(1 if errors else 0)
"""


def test_two_groups_joined_at_once_in_opposite_orders_both_form() -> None:
    from megatron_areal.weights.wire import WeightUpdateGroup

    port0, port1 = free_ports(2)
    members = [subprocess.Popen([sys.executable, "-c", MEMBER, str(port0), str(port1), str(rank), first],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank, first in ((1, "g0"), (2, "g1"))]
    errors: list[str] = []
    groups: list[WeightUpdateGroup] = []

    def host(name: str, port: int) -> None:
        try:
            groups.append(WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=3,
                                            group_name=name, timeout_s=20))
            groups[-1].barrier()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {e}")

    start = time.monotonic()
    hosts = [threading.Thread(target=host, args=("g0", port0)), threading.Thread(target=host, args=("g1", port1))]
    for t in hosts:
        t.start()
    for t in hosts:
        t.join(timeout=90)
    outputs = [m.communicate(timeout=90)[0] for m in members]
    for g in groups:
        g.destroy()
    assert not errors, f"host side after {time.monotonic() - start:.0f}s: {errors}; members: {outputs}"
    assert all(m.returncode == 0 for m in members), outputs
