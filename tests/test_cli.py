"""Every command ``megatron-areal --help`` lists can be started (its module imports, --help answers);
``serve`` takes the engine's defaults from the engine."""
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


def test_serve_leaves_unset_engine_options_at_the_engines_defaults(tiny_llama) -> None:
    from megatron_areal.server.cli import engine_options, parse_args
    from megatron_areal.server.engine import EngineOptions

    assert engine_options(parse_args(["--model", str(tiny_llama)])) == EngineOptions()
    given = engine_options(parse_args(["--model", str(tiny_llama), "--max-running", "5", "--health-timeout", "3"]))
    assert (given.max_running, given.health_timeout_s) == (5, 3.0)
    assert given.max_queue == EngineOptions().max_queue
