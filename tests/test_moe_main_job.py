"""The main job on a tiny Qwen3-MoE with two trainer ranks at expert parallelism 2.

``megatron-areal train`` with ``parallel.ep: 2`` over ``cluster.cpu_dp: 2`` (each rank holds 4 of
the 8 experts), one embedded server returning its routes, routing replay on. The run trains,
pushes every expert to the server after each step (what arrives is checked tensor by tensor in
test_realloc_moe.py), checkpoints at EP2, and a second command resumes from that checkpoint and
trains one more step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_main_job import train
from tiny_moe import make_tiny_qwen3_moe

from megatron_areal.util.netutil import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def moe_config(model: Path, run_dir: Path, steps: int) -> dict:
    return {
        "train": {"run_dir": str(run_dir), "steps": steps, "eval_every": 0, "seed": 3},
        "model": {"path": str(model), "max_seq_len": 128},
        "parallel": {"ep": 2},
        "ppo": {"routing_replay": True},
        "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 8, "max_concurrent": 4,
                    "temperature": 1.0, "filter_equal_rewards": False, "return_routed_experts": True},
        "staleness": {"eta": 1},
        "server": {"count": 1, "max_running": 8, "base_port": free_port()},
        "cluster": {"master_port": free_port(), "cpu_dp": 2, "stop_grace_s": 5},
        "data": {"train": "arithmetic", "train_size": 64, "eval": "", "seed": 3},
        "reward": {"workers": 1},
        "checkpoint": {"every": 1, "keep": 1, "resume": True},
        "logging": {"progress": False},
    }


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_moe_trains_pushes_checkpoints_and_resumes_at_expert_parallel_2(tmp_path: Path) -> None:
    model = make_tiny_qwen3_moe(tmp_path / "model", seed=5)
    run_dir = tmp_path / "run"
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump(moe_config(model, run_dir, steps=2)))
    first = train(config)
    log = (run_dir / "logs/trainer.log").read_text() if (run_dir / "logs/trainer.log").exists() else ""
    assert first.returncode == 0, f"{first.stderr[-3000:]}\n{log[-3000:]}"
    assert "ep=2" in log
    steps = [m for m in _metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("train/routing_mismatch" not in m or m["train/routing_mismatch"] >= 0 for m in steps)

    config.write_text(yaml.safe_dump(moe_config(model, run_dir, steps=3)))
    second = train(config)
    log = (run_dir / "logs/trainer.log").read_text()
    assert second.returncode == 0, f"{second.stderr[-3000:]}\n{log[-3000:]}"
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert resumed and resumed[-1].endswith("(step 2)"), resumed
    assert [m["step"] for m in _metrics(run_dir) if "train/loss" in m][-1] == 3
