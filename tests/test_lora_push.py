"""A ``model.lora`` run pushes only its adapters, and the servers serve what the trainer trains.

``megatron-areal train`` on the tiny Llama with the learnable task of tests/test_learning_e2e.py (so the
adapters move from their start), synchronous (eta 0): each step's rollouts come from the weights of the step
before, so the trainer's logprobs of them and the server's agree to fp32 precision only if the server holds
base + B @ A * scale of the adapters the trainer holds (``train/rollout_mismatch_abs``, about 1e-7 when they
match; a server left on the base model after the adapters moved reads about 1e-2 and more). The bytes each
push moved (``weights/bytes_pushed``) are those of A and B, a small fraction of the model's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from test_learning_e2e import config as learning_config
from test_main_job import train

from megatron_areal.convert.cli import main as convert_main

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
STEPS = 4
MISMATCH = 1e-5  # fp32 on both sides measures about 1e-7; a stale server 1e-2 and more


def model_bytes(folder: Path, pattern: str = "*.safetensors") -> int:
    """Bytes of every tensor of a safetensors folder in fp32 (what a push of them moves in an fp32 run)."""
    total = 0
    for path in folder.glob(pattern):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iterator
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 4  # the run pushes fp32
    return total


def lora_config(root: Path, **server: object) -> dict:
    cfg = learning_config(root)
    cfg["train"]["steps"] = STEPS
    cfg["model"]["lora"] = dict(LORA)
    cfg["checkpoint"] = {"every": STEPS, "keep": 1}
    cfg["server"].update(server)
    return cfg


def check_adapter_run(cfg: dict, root: Path, result, *, max_mismatch: float = MISMATCH,
                      model: Path | None = None) -> list[dict]:
    from megatron_areal.checkpoint.training import latest_checkpoint
    from megatron_areal.model.assets import tiny_model_path

    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((root / "run/logs").glob("*.log")))
    assert result.returncode == 0, f"train failed ({result.returncode}):\n{result.stderr[-3000:]}\n{logs}"
    rows = [json.loads(line) for line in (root / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/bytes_pushed" in r]
    assert len(steps) == STEPS, [sorted(r) for r in rows]
    # the adapters moved (B starts at zero): a server that did not take them would serve the base model
    ckpt = latest_checkpoint(root / "run/checkpoints")
    assert convert_main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(root / "peft"), "--adapter-only"]) == 0
    with safe_open(str(root / "peft/adapter_model.safetensors"), framework="pt") as f:
        b = [f.get_tensor(n).abs().max().item() for n in f.keys() if ".lora_B." in n]  # noqa: SIM118
    assert max(b) > 1e-3, b
    # each push moved exactly the adapters PEFT saves (fp32), not the model
    adapter = model_bytes(root / "peft", "adapter_model.safetensors")
    assert [r["weights/bytes_pushed"] for r in steps] == [adapter] * STEPS
    assert adapter < 0.1 * model_bytes(model or Path(tiny_model_path("llama")))
    mismatch = [r["train/rollout_mismatch_abs"] for r in rows if "train/rollout_mismatch_abs" in r]
    assert len(mismatch) == STEPS and max(mismatch) < max_mismatch, mismatch
    return steps


@pytest.mark.slow
def test_a_lora_run_pushes_only_adapters_to_the_embedded_server(tmp_path: Path) -> None:
    cfg = lora_config(tmp_path)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check_adapter_run(cfg, tmp_path, train(path, timeout=600))


@pytest.mark.slow
def test_adapters_gathered_over_tp_and_pp_reach_the_server(tmp_path: Path) -> None:
    """TP2 x PP2: A (row-parallel) and B (column-parallel) are split over TP and the layers over two stages;
    each stage head gathers its stage's halves and pushes them (four trainer ranks)."""
    cfg = lora_config(tmp_path)
    cfg["parallel"] = {"tp": 2, "pp": 2}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check_adapter_run(cfg, tmp_path, train(path, timeout=800))
