"""Network helpers shared by the launch tests."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_areal.util.netutil import free_port, port_free


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive ports that were all free a moment ago: a fleet on Slurm takes
    ``server.count x cluster.server_port_stride`` ports from ``server.base_port`` as they are (only the local
    launcher moves busy ones), so a free base alone can put a later server on a port in use."""
    while True:
        base = free_port()
        if base + n <= 65536 and all(port_free("127.0.0.1", p) for p in range(base, base + n)):
            return base


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago."""
    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(avoid=ports))
    return ports


def http_call(url: str, path: str, body: Any = None, *, raw: bytes | None = None, key: str | None = None,
              method: str | None = None, timeout: float = 60.0,
              parse_constant: Callable[[str], Any] | None = None) -> tuple[int, Any]:
    """One HTTP request: POST a JSON ``body`` (or ``raw`` bytes), GET without one; returns (status,
    parsed JSON or text). An error status is returned, not raised; no reply at all raises OSError."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text, parse_constant=parse_constant)
    except json.JSONDecodeError:
        return status, text


@contextmanager
def paused(url: str, mode: str = "in_place", *, key: str | None = None) -> Iterator[None]:
    """The server paused (``in_place``: running requests keep their slots and do not decode) for the
    body of the ``with``, and generating again afterwards even when the body fails, so a failing test
    cannot leave a shared server paused for the next one."""
    assert http_call(url, "/pause_generation", {"mode": mode}, key=key)[0] == 200
    try:
        yield
    finally:
        assert http_call(url, "/continue_generation", {}, key=key)[0] == 200
