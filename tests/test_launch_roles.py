"""A run without Slurm: the per-role entry scripts of ``launch/`` started as a cluster would start them on two
nodes (here both on this machine), each placed only by the environment torchrun and Kubernetes set."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from netutil import free_ports

from megatron_areal.config import load_config
from megatron_areal.launch.env_node import env_plan, read_node_env
from megatron_areal.run.errors import LaunchError
from megatron_areal.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/train_tiny.yaml"


def test_the_environment_of_a_pytorchjob_places_each_node() -> None:
    """Kubeflow's PyTorchJob sets WORLD_SIZE and RANK per pod (one pod a node), MASTER_ADDR/PORT for the first."""
    cfg = load_config(CONFIG, [])
    trainer = read_node_env("trainer", {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.5",
                                        "MASTER_PORT": "23456", "POD_IP": "10.0.0.6",
                                        "MEGATRON_AREAL_ROLLOUT_NODES": "3"}, cfg)
    assert (trainer.rank, trainer.trainer_nodes, trainer.rollout_nodes) == (1, 2, 3)
    assert (trainer.master_addr, trainer.master_port, trainer.addr) == ("10.0.0.5", 23456, "10.0.0.6")
    plan = env_plan(trainer, cfg)
    assert plan.trainer.nodes == ("trainer-0", "trainer-1")
    assert (plan.trainer.master_addr, plan.trainer.master_port) == ("10.0.0.5", 23456)
    assert plan.node("trainer-1").addr == "10.0.0.6"
    assert {s.node for s in plan.servers} <= {"rollout-0", "rollout-1", "rollout-2"}
    # a rollout node of an Indexed Job sees the same servers, with its own address on its own
    rollout = read_node_env("rollout", {"NNODES": "3", "JOB_COMPLETION_INDEX": "2", "MEGATRON_AREAL_TRAINER_NODES": "2",
                                        "MEGATRON_AREAL_NODE_ADDR": "10.0.1.2"}, cfg)
    seen = env_plan(rollout, cfg)
    assert [s.id for s in seen.servers] == [s.id for s in plan.servers]
    assert all(s.addr == "10.0.1.2" for s in seen.servers_on("rollout-2"))


@pytest.mark.parametrize(("role", "env", "named"), [
    ("trainer", {"WORLD_SIZE": "1"}, "MASTER_ADDR"),
    ("trainer", {"NNODES": "two", "MASTER_ADDR": "h"}, "NNODES='two'"),
    ("rollout", {"NNODES": "2", "NODE_RANK": "2"}, "node rank 2 is outside the 2 rollout node"),
    ("rollout", {"MEGATRON_AREAL_TRAINER_NODES": "0"}, "MEGATRON_AREAL_TRAINER_NODES=0"),
])
def test_a_bad_environment_is_named(role: str, env: dict[str, str], named: str) -> None:
    with pytest.raises(LaunchError, match=named.replace("(", r"\(")):
        read_node_env(role, env, load_config(CONFIG, []))


@pytest.fixture(scope="module", autouse=True)
def _model(tiny_llama: Path) -> None:
    """Prepare the tiny model once so the nodes do not spend the test's time converting it."""


def _start(script: str, env: dict[str, str], *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(ROOT / "launch" / script), str(CONFIG), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env})


def _left(run_dir: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if any(str(run_dir) in a for a in p.info["cmdline"] or [])]


def test_a_trainer_node_and_a_rollout_node_run_a_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base, master = free_ports(2)
    overrides = (f"train.run_dir={run_dir}", f"server.base_port={base}", "server.count=1", "train.steps=2",
                 "checkpoint.every=0", "cluster.stop_grace_s=5")
    here = {"MEGATRON_AREAL_NODE_ADDR": "127.0.0.1"}
    rollout = _start("rollout_node.sh", {**here, "NNODES": "1", "NODE_RANK": "0",
                                         "MEGATRON_AREAL_TRAINER_NODES": "1"}, *overrides)
    trainer = _start("trainer_node.sh", {**here, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(master), "MEGATRON_AREAL_ROLLOUT_NODES": "1"}, *overrides)
    try:
        trainer_out, _ = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, trainer_out[-4000:]
        rollout.send_signal(signal.SIGTERM)  # rollout nodes run until stopped
        rollout_out, _ = rollout.communicate(timeout=60)
    finally:
        for p in (trainer, rollout):
            p.kill()
    run = RunDir(run_dir)
    steps = [json.loads(line)["step"] for line in run.metrics.read_text().splitlines() if line.strip()]
    assert {1, 2} <= set(steps) and max(steps) == 2, steps  # the two steps trained (step 0: the start)
    plan = json.loads(run.plan.read_text())  # written by the first trainer node
    assert plan["trainer"]["nodes"] == ["trainer-0"] and [s["id"] for s in plan["servers"]] == ["rollout-0-0"]
    assert (run.logs / "server-rollout-0-0.log").is_file() and (run.logs / "torchrun-trainer-0.log").is_file()
    assert "SIGTERM" in rollout_out, rollout_out[-4000:]
    assert not _left(run_dir), [p.info["cmdline"] for p in _left(run_dir)]
