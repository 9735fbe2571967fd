"""Training on whole conversations learns: ``megatron-areal train`` with an agent whose reward depends on
its second turn, after feedback from the environment (``agent_examples.answer_after_feedback``).

The tiny random Llama of ``test_learning_e2e`` plays two-turn episodes: reply, read "Wrong. The
answer is 0.", reply again; the second reply earns 1 when its last number is 0 (about 4% of random
8-character replies). Each episode is one sequence whose environment tokens carry no loss; both replies
share the episode's advantage. The run is synchronous (eta 0), so each step's reward is that of the
policy trained on the step before. With the mask or the advantages wrong, the reward stays near 0.
A run measured 0.00 0.03 0.09 ... 0.34 0.72 0.53 (early mean 0.04, late 0.53); about 6 minutes on a busy
two-core machine.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_learning_e2e import MARGIN, WINDOW
from test_learning_e2e import config as single_turn_config
from test_main_job import train

HERE = Path(__file__).parent
# Twice the single-turn test's steps: two turns share one advantage and the first reply's tokens add noise,
# so 12 steps rose by 0.49 in one run and by only 0.12 in another.
STEPS = 24


@pytest.mark.slow
def test_second_turn_reward_rises_over_a_few_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_areal.rundir.layout import RunDir

    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the trainer imports the agent from agent_examples
    cfg = single_turn_config(tmp_path)
    cfg["train"]["steps"] = STEPS
    cfg["model"]["max_seq_len"] = 128
    cfg["rollout"].update(workflow="agent_examples:answer_after_feedback", max_turns=2, max_episode_tokens=128)
    path = tmp_path / "feedback.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = train(path, timeout=900)
    assert result.returncode == 0, f"train failed ({result.returncode}):\n{result.stderr[-3000:]}"
    rows = [json.loads(line) for line in RunDir(cfg["train"]["run_dir"]).metrics.read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == STEPS, rows
    turns = [r["agent/turns_mean"] for r in rows if "agent/turns_mean" in r]
    assert turns and min(turns) == 2.0, turns
    assert all(r.get("agent/trajectories_per_episode", 1.0) == 1.0 for r in rows)
    # the trainer's logprobs on the trained tokens of whole conversations match the server's (measured ~1e-7)
    mismatch = [r["train/rollout_mismatch_abs"] for r in rows if "train/rollout_mismatch_abs" in r]
    assert mismatch and max(mismatch) <= 1e-5, mismatch
    early, late = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    curve = " ".join(f"{r:.2f}" for r in rewards)
    assert late - early >= MARGIN, f"reward did not rise: early {early:.2f}, late {late:.2f}; per step: {curve}"
