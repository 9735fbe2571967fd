"""The main job learns: ``megatron-areal train`` on the tiny random Llama raises its reward.

The task is one a 4-layer random model with a character-level tokenizer can learn in a few steps:
every prompt's answer is 0 and the reply is scored by the built-in ``arithmetic`` verifier (the
last number in the reply must equal the answer), so a reply earns 1 when its last number is
written with zeros only. A random policy over 128 characters hits that in about 4% of 8-token
replies; the learned policy writes zeros. The run is synchronous (eta 0), so each step's reward
is the reward of the policy trained on the step before.

With the loss or the advantages of the wrong sign the policy moves away from the rewarded replies
and the reward stays near 0. Takes about a minute on two cores (most of it start-up).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_main_job import train

from megatron_areal.util.netutil import free_port

STEPS = 12
WINDOW = 3  # steps averaged at each end
MARGIN = 0.3  # late mean reward - early mean reward; a run measured 0.03 -> 0.89 (random policy: about 0.04)


def config(root: Path) -> dict:
    data = root / "zeros.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "0", "task": "arithmetic"}) + "\n"
                            for i in range(64)))
    return {
        "train": {"run_dir": str(root / "run"), "steps": STEPS, "eval_every": 0, "seed": 3},
        "model": {"path": "tiny-llama", "max_seq_len": 64},
        "optimizer": {"distributed": False, "lr": 1e-2},
        "rollout": {"batch_size": 4, "group_size": 8, "max_new_tokens": 8, "max_concurrent": 8,
                    "temperature": 1.0, "filter_equal_rewards": False},  # every group counts in the mean
        "staleness": {"eta": 0},
        "server": {"count": 1, "max_running": 32, "base_port": free_port()},
        "cluster": {"master_port": free_port(), "stop_grace_s": 5},
        "data": {"train": str(data), "eval": ""},
        "reward": {"workers": 1},
        "checkpoint": {"every": 0, "keep": 1},
        "logging": {"progress": False},
    }


@pytest.mark.slow
def test_reward_rises_over_a_few_steps(tmp_path: Path) -> None:
    from megatron_areal.rundir.layout import RunDir

    cfg = config(tmp_path)
    path = tmp_path / "zeros.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = train(path, timeout=400)
    run = RunDir(cfg["train"]["run_dir"])
    assert result.returncode == 0, f"train failed ({result.returncode}):\n{result.stderr[-3000:]}"
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == STEPS, rows
    early, late = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert late - early >= MARGIN, f"reward did not rise: early {early:.2f}, late {late:.2f}; per step: {curve}"
