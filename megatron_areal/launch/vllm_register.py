"""Register a vLLM server in the run directory once its ``/health`` answers (``launch/vllm.exec_server``
starts this beside the server): ``python -m megatron_areal.launch.vllm_register DIR ID URL PID MODEL``.

Gives up (without registering) when the server's process is gone; the launcher reports that death.
"""
from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request

from megatron_areal.server.cli import write_registration


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    directory, server_id, url, pid, model = argv
    while running(int(pid)):
        if healthy(url):
            write_registration(directory, server_id, {"url": url, "pid": int(pid), "model": model})
            return 0
        time.sleep(1.0)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
