"""Every command ``megatron-areal --help`` lists can be started (its module imports, --help answers);
``serve`` and a run's servers take their defaults from one place (``server/config.EngineOptions``)."""
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
    from megatron_areal.server.config import EngineOptions

    assert engine_options(parse_args(["--model", str(tiny_llama)])) == EngineOptions()
    given = engine_options(parse_args(["--model", str(tiny_llama), "--max-running", "5", "--health-timeout", "3"]))
    assert (given.max_running, given.health_timeout_s) == (5, 3.0)
    assert given.max_queue == EngineOptions().max_queue


def test_a_runs_servers_take_the_engines_defaults() -> None:
    from megatron_areal.server.config import EngineOptions, ServerConfig

    engine, run = EngineOptions(), ServerConfig()
    assert (run.max_running, run.max_queue) == (engine.max_running, engine.max_queue)
    for unread in ("seed", "device", "dtype"):  # the launcher passes train.seed, model.dtype, the plan's device
        assert not hasattr(run, unread)


def test_context_length_is_the_option_else_the_models_window_up_to_2048() -> None:
    from megatron_areal.server.config import EngineOptions

    assert EngineOptions().context_length_for(8192) == 2048  # SmolLM2's window: the cache would be 4x
    assert EngineOptions().context_length_for(512) == 512
    assert EngineOptions(context_length=32768).context_length_for(512) == 32768  # given: taken as it is
