"""The main job with ``server.engine: vllm``: ``megatron-areal train`` against a real vLLM CPU server learns,
and survives the server being killed.

The run is ``test_learning_e2e``'s (a tiny random Llama learns to answer with zeros; synchronous, so each
step's reward is the previous step's policy's) with the rollout server a vLLM CPU process started by
the launcher from the vLLM environment (``server.python``), two of them. It is held after step ``HOLD_AT``,
one vLLM server is killed with SIGKILL, the launcher starts it again on its port, and the run must finish: the
trainer re-admits the fresh server with the current weights, and the reward must still rise.

Skipped, with the reason, only where the vLLM environment is absent; CI installs it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_learning_e2e import MARGIN, WINDOW, config
from test_server_restart import read_json, run_logs, wait_until
from test_vllm import VLLM_PYTHON

pytestmark = pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                                reason=f"no vLLM environment at {VLLM_PYTHON} (scripts/install_vllm.sh makes it)")

HOLD_AT = 6
# Twice test_learning_e2e's 12 steps: this head_dim-32 model's reward starts rising only around step 10 on
# either engine, and after the kill a few steps with no rewarded sample (no gradient) are common, so a
# 12-step run passed or failed by chance (measured: 0.02 -> 0.00 at 12 steps, 0.00 -> 0.97 at 24, same seed).
STEPS = 24
MAX_MISMATCH = 1e-3  # mean |trainer - behaviour| logprob a step; a server on other weights is off by far more
RUN_TIMEOUT_S = 1800  # two vLLM starts (each imports vLLM in three processes) on a shared 2-core machine


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_main_job_on_vllm_learns_and_readmits_a_killed_server(tmp_path: Path) -> None:
    from megatron_areal.model.assets import make_tiny_model
    from megatron_areal.rundir.layout import RunDir

    cfg = config(tmp_path)
    cfg["train"]["steps"] = STEPS
    # the tiny random Llama of test_learning_e2e with head_dim 32 (vLLM's CPU attention has no 16)
    cfg["model"]["path"] = str(make_tiny_model(tmp_path / "model", "llama", num_heads=2, num_kv_heads=2))
    # two servers: while the killed one is down the other generates (a run with one server waits for a
    # batch that no server can produce, and the weight sync that would re-admit it comes after that batch)
    cfg["server"].update(engine="vllm", python=VLLM_PYTHON, count=2, startup_timeout_s=900, max_restarts=2,
                         restart_backoff_s=0.5)
    cfg["weights"] = {"timeout_s": 300}
    # 16 samples a prompt (64 a step): with 32, a step without any rewarded reply (no gradient) had a chance
    # near 1 in 4 under the random policy, and Adam's momentum kept moving the weights through such steps; a
    # run drifted away from the zeros and scored 0 on its last 18 steps (0.02 -> 0.00).
    cfg["rollout"]["group_size"] = 16
    path = tmp_path / "zeros-vllm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = Path(cfg["train"]["run_dir"])
    hold = run_dir / "control" / "hold"
    hold.parent.mkdir(parents=True)
    hold.write_text(str(HOLD_AT))
    with open(tmp_path / "launcher.out", "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "megatron_areal.cli", "train", str(path)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: (read_json(run_dir / "control" / "held") or {}).get("step") == HOLD_AT,
                   f"a hold at step {HOLD_AT}", tmp_path, launcher, RUN_TIMEOUT_S)
        reg = run_dir / "servers"
        victim = sorted(p.name for p in reg.iterdir() if not p.name.startswith("."))[0]
        old_pid = int(read_json(reg / victim)["pid"])
        os.kill(old_pid, signal.SIGKILL)
        # the launcher starts it again on its port; the wrapper registers the new process once healthy
        wait_until(lambda: (read_json(reg / victim) or {}).get("pid") not in (None, old_pid),
                   f"vLLM server {victim} back", tmp_path, launcher, 900)
        hold.unlink()
        rc = launcher.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=120)
    assert rc == 0, run_logs(tmp_path)

    trainer_log = (run_dir / "logs/trainer.log").read_text()
    assert "re-admitted" in trainer_log, trainer_log[-4000:]
    rows = [json.loads(line) for line in RunDir(str(run_dir)).metrics.read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == STEPS, rows
    story = run_story(rows, trainer_log)
    # Every server, the re-admitted one included, samples from the trainer's weights: the behaviour
    # logprobs equal the trainer's on every step (fp32 on both sides: about 1e-7).
    assert all("train/rollout_mismatch_abs" in r for r in rows), f"a step without its mismatch:\n{story}"
    mismatch = [r["train/rollout_mismatch_abs"] for r in rows]
    assert max(mismatch) < MAX_MISMATCH, f"a server's rollouts disagree with the trainer's weights:\n{story}"
    # trained.jsonl records the rewards of the very batch each step trained on
    ledger = [json.loads(line) for line in RunDir(str(run_dir)).trained.read_text().splitlines()]
    assert [sum(e["rewards"]) / len(e["rewards"]) for e in ledger] == pytest.approx(rewards), story
    early, late = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert late - early >= MARGIN, f"reward did not rise on vLLM: early {early:.2f}, late {late:.2f}:\n{story}"


def run_story(rows: list[dict], trainer_log: str) -> str:
    """What a failure needs to be read: per step the reward, reward failures, entropy, gradient norm,
    response length, mismatch and healthy servers, then the trainer's warnings and errors."""
    keys = {"reward": "rollout/reward_mean", "reward_fail": "rollout/reward_failures", "entropy": "train/entropy",
            "grad_norm": "train/grad_norm", "resp_len": "rollout/response_len_mean",
            "mismatch": "train/rollout_mismatch_abs", "healthy": "rollout/healthy_servers"}
    lines = ["step " + " ".join(f"{k:>11}" for k in keys)]
    lines += [f"{r.get('step', '?'):>4} " + " ".join(f"{r.get(key, float('nan')):11.3g}" for key in keys.values())
              for r in rows]
    lines += [line for line in trainer_log.splitlines() if " WARNING " in line or " ERROR " in line][-40:]
    return "\n".join(lines)
