"""Every command ``megatron-areal --help`` lists can be started (its module imports, --help answers)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_areal.cli import COMMANDS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_listed_command_answers_help(name: str) -> None:
    run = subprocess.run([sys.executable, "-m", "megatron_areal.cli", name, "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"megatron-areal {name} --help: {run.stderr[-2000:]}"
    assert "usage" in (run.stdout + run.stderr).lower()
