"""Configurations built to hurt, or that cannot train, are refused at load with a short error naming the key.

- A YAML alias bomb (anchors that reference anchors: 336 bytes that expand to 43 million strings) in the
  config file or in a dotted override is refused before it is expanded or printed.
- A temperature too small for the trainer's logprobs, a run directory that is a file, and a workflow
  that is not an async function of ``(task, client)`` fail ``--dry-run`` instead of the run, later.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_areal.config import ConfigError, load_config
from megatron_areal.launch.cli import main as train_main

ROOT = Path(__file__).resolve().parents[1]

# The classic "billion laughs", in YAML: nine levels of nine references each under train.run_dir.
LEVELS = "abcdefgh"
BOMB_VALUE = "[&a [lol,lol,lol,lol,lol,lol,lol,lol,lol], " + ", ".join(
    f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip(LEVELS, LEVELS[1:], strict=False)) + "]"
BOMB_FILE = f"train:\n  run_dir: {BOMB_VALUE}\n"


def test_the_bomb_is_the_real_one() -> None:
    """The input is small and would expand to 9**8 strings: 43 million."""
    assert len(BOMB_FILE) < 400
    assert BOMB_VALUE.count("*") == 7 * 9


@pytest.mark.timeout(60)
def test_alias_bomb_in_the_yaml_file_is_refused_briefly(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB_FILE)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert len(message) < 1000, message[:300]
    assert str(path) in message and "YAML aliases expand" in message, message


@pytest.mark.timeout(60)
def test_alias_bomb_in_a_dotted_override_is_refused_briefly() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/train_tiny.yaml", [f"train.run_dir={BOMB_VALUE}"])
    message = str(e.value)
    assert len(message) < 1000, message[:300]
    assert "train.run_dir" in message and "YAML aliases expand" in message, message


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("train:\n  run_dir: &a [*a]\n")
    with pytest.raises(ConfigError, match="recursive alias"):
        load_config(path)


def test_modest_aliases_still_load(tmp_path: Path) -> None:
    """What users write aliases for: one value reused in a few places."""
    path = tmp_path / "ok.yaml"
    path.write_text("server:\n  extra_args: &args [--a, --b]\n  count: 2\nrollout:\n  batch_size: &b 4\n"
                    "  group_size: *b\n")
    cfg = load_config(path)
    assert cfg.rollout.group_size == 4 and cfg.server.extra_args == ["--a", "--b"]


@pytest.mark.parametrize("override", ["train.steps=" + "x" * 1_000_000, "train." + "x" * 1_000_000 + "=1",
                                      "train.steps.x" + "y" * 1_000_000 + "=1", "train.steps=[" + "1," * 50_000],
                         ids=["long-value", "long-key", "long-subkey", "long-list"])
def test_a_long_value_or_key_in_an_error_is_shortened(override: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert len(str(e.value)) < 1000 and "train." in str(e.value)


# ---- settings that cannot train ---------------------------------------------------------------------


def _trainer_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    from megatron_areal.actor.logprobs import vocab_parallel_logprobs

    targets = torch.zeros(logits.shape[0], dtype=torch.long)
    return vocab_parallel_logprobs(logits, targets, tp_group=None, tp_rank=0, vocab_size=logits.shape[1],
                                   temperature=temperature)[0]


def test_the_trainer_logprobs_are_nan_at_the_temperature_once_accepted() -> None:
    """Why a bound exists: logits of an ordinary size over 1e-40 overflow fp32, and inf - inf is NaN. The bound
    itself is vLLM's (``_MAX_TEMP`` in its ``sampling_params.py``): it samples any temperature in (0, 0.01) at
    0.01 "to avoid nan or inf", so below it the trainer would score tokens at another temperature than the
    server drew them at. At the bound the trainer's logprobs are finite and match float64."""
    from megatron_areal.rollout.config import MIN_TEMPERATURE

    logits = torch.tensor([[12.0, -3.0, 7.5, 0.25], [-1.0, 30.0, 29.0, 2.0]])
    assert torch.isnan(_trainer_logprobs(logits, 1e-40)).any()
    at_bound = _trainer_logprobs(logits, MIN_TEMPERATURE)
    assert torch.isfinite(at_bound).all()
    # the reference: log_softmax in float64
    expected = torch.log_softmax(logits.double() / MIN_TEMPERATURE, -1)[:, 0]
    assert torch.allclose(at_bound.double(), expected, rtol=1e-4)


@pytest.mark.parametrize("value", ["1e-40", "5e-324", "1e-7", "9e-6", "0.005"])
def test_temperatures_below_the_bound_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(None, [f"rollout.temperature={value}"])


@pytest.mark.parametrize("value", ["0", "0.0", "0.01", "0.7", "2"])
def test_greedy_and_ordinary_temperatures_load(value: str) -> None:
    assert load_config(None, [f"rollout.temperature={value}"]).rollout.temperature == float(value)


def test_run_dir_naming_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("x")
    for run_dir in (file, file / "run"):
        with pytest.raises(ConfigError, match="train.run_dir"):
            load_config(None, [f"train.run_dir={run_dir}"])
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        load_config(None, [f"checkpoint.dir={file}"])
    assert load_config(None, [f"train.run_dir={tmp_path / 'fresh' / 'run'}"])


@pytest.mark.parametrize("spec", ["os:system", "math:pi", "json:loads", "megatron_areal.agent.workflow:run_bounded",
                                  "no_such_module_x:run"])
def test_workflow_that_is_not_an_async_function_of_task_and_client_is_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match="rollout.workflow"):
        load_config(None, [f"rollout.workflow={spec}"])


def test_the_packaged_agents_load() -> None:
    cfg = load_config(ROOT / "configs/smollm2_calculator.yaml")
    assert cfg.rollout.workflow


def test_dry_run_fails_naming_the_key(tiny_llama, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    cases = (("rollout.temperature=1e-40", "rollout.temperature"), (f"train.run_dir={file}", "train.run_dir"),
             ("rollout.workflow=os:system", "rollout.workflow"))
    for override, key in cases:
        rc = train_main([str(ROOT / "configs/train_tiny.yaml"), "--dry-run", override])
        out = capsys.readouterr().out
        assert rc != 0 and key in out and "FAILED" in out, out



def test_disk_weight_folder_naming_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "weights"
    file.write_text("")
    with pytest.raises(ConfigError, match="weights.disk_dir"):
        load_config(None, ["weights.method=disk", f"weights.disk_dir={file}"])
    assert load_config(None, ["weights.method=disk", f"weights.disk_dir={tmp_path / 'new'}"])


def test_dry_run_fails_on_a_missing_eval_dataset(tiny_llama, capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """The run reads data.eval only once started (the starting policy's evaluation), where it would die."""
    rc = train_main([str(ROOT / "configs/train_tiny.yaml"), "--dry-run", f"data.eval={tmp_path / 'none.jsonl'}"])
    out = capsys.readouterr().out
    assert rc != 0 and "FAILED: data.eval" in out, out
