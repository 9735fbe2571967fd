"""A ``model.lora`` run end to end: ``megatron-areal train`` on a tiny Llama with an embedded rollout server
(adapter pushes: tests/test_lora_push.py), two steps and a checkpoint, whose ``--adapter-only`` export the
real ``peft`` loads.

The wiring only: a random tiny model earns no reward, so its gradients are zero and the adapters stay at
their start (``B = 0``); tests/test_lora.py trains adapters and checks the numbers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_main_job import tiny_config, train


@pytest.mark.slow
def test_a_lora_run_trains_pushes_and_exports_for_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_areal.checkpoint.training import latest_checkpoint
    from megatron_areal.convert.cli import main as convert_main
    from megatron_areal.model.assets import tiny_model_path

    cfg = tiny_config(tmp_path / "run")
    cfg["train"]["steps"] = 2
    cfg["model"]["lora"] = {"rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
    cfg["optimizer"]["lr"] = 1e-2
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = train(path)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "run/logs").glob("*.log")))
    assert result.returncode == 0, f"train failed ({result.returncode}):\n{result.stderr[-3000:]}\n{logs}"
    ledger = [json.loads(line) for line in (tmp_path / "run/trained.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == [1, 2]

    ckpt = latest_checkpoint(tmp_path / "run/checkpoints")
    assert ckpt is not None and json.loads((ckpt / "megatron_areal.json").read_text())["lora"]["rank"] == 8
    assert convert_main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--adapter-only"]) == 0
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert a.shape == (8, base.config.hidden_size) and a.abs().max() > 0  # PEFT holds the run's adapters
    assert not hasattr(model.base_model.model.model.layers[0].mlp.up_proj, "lora_A")  # only the targets
