"""The SGLang server's command line for one rollout slot (``python -m sglang.launch_server ...``).

The node role starts it as a child process and waits for its ``/health`` (``launch/server_process``).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SGLangLaunch:
    """How to start one SGLang rollout server: ``command()`` is its argv, ``url`` its address."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp: int = 1
    mem_fraction: float | None = 0.85
    api_key: str | None = field(default=None, repr=False)  # never printed: see key_config
    weight_version: str | None = None
    seed: int | None = None
    context_length: int | None = None
    max_running: int | None = None
    extra_args: tuple[str, ...] = ()
    _key_file: str | None = field(default=None, init=False, repr=False, compare=False)

    def command(self, python: str = sys.executable) -> list[str]:
        """``python -m sglang.launch_server`` with the flags a rollout node needs.

        ``--dp-size 1``: weight updates over NCCL assume one data-parallel replica per server. The API
        key is not a flag: see ``key_config``.
        """
        cmd = [python, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--tp-size", str(self.tp), "--dp-size", "1", "--host", self.host, "--port", str(self.port)]
        optional = {"--mem-fraction-static": self.mem_fraction, "--config": self.key_config(),
                    "--weight-version": self.weight_version, "--random-seed": self.seed,
                    "--context-length": self.context_length, "--max-running-requests": self.max_running}
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + list(self.extra_args)

    def key_config(self) -> str | None:
        """A YAML file, readable by its owner only, that gives SGLang its API key.

        SGLang 0.5.23 takes the key from ``--api-key`` or from ``--config FILE.yaml`` and reads no
        environment variable for it; ``--config`` is merged into the arguments in memory
        (``ConfigArgumentMerger`` in ``sglang/srt/utils/server_args_config_parser.py``), so the key
        never shows in ``/proc/PID/cmdline``. One file per spec, written on first use."""
        if not self.api_key:
            return None
        if self._key_file is None:
            fd, path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".yaml")  # mode 0600
            with os.fdopen(fd, "w") as f:
                # the merger makes "--<key>" of each key as written; a JSON string is a YAML string
                f.write(f"api-key: {json.dumps(str(self.api_key))}\n")
            self._key_file = path
        return self._key_file

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
