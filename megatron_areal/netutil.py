"""Small network helpers shared by the launchers, the weight path and the tests."""
from __future__ import annotations

import socket
from collections.abc import Container


def free_port(host: str = "127.0.0.1", avoid: Container[int] = ()) -> int:
    """A TCP port that is free on ``host`` now (and not in ``avoid``); racy by nature, so callers
    that start many listeners pass the ports they already handed out."""
    host = "127.0.0.1" if host == "localhost" else host
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
