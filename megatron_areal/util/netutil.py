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


def port_free(host: str, port: int) -> bool:
    """Nothing listens on ``port`` at ``host`` now. Connections of a stopped server lingering in TIME_WAIT
    don't count: a server binds with ``SO_REUSEADDR`` (uvicorn and torch's TCP store do), and so does this."""
    host = "127.0.0.1" if host == "localhost" else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
