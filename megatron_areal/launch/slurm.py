"""The batch step of a Slurm job: read the allocation, plan, and start each role with ``srun``.

Flow: nodes from ``scontrol show hostnames $SLURM_JOB_NODELIST`` (addresses from ``scontrol show
node``), GPUs per node from the Slurm environment -> plan -> ``RUN_DIR/plan.json`` -> one ``srun``
step over the rollout nodes (``node_role rollout``) -> wait for every server to register -> one
``srun`` step over the trainer nodes (``node_role trainer``, torchrun with the first trainer node
as rendezvous). When the trainer step ends, the rollout step is stopped. A requeued job
(``SLURM_RESTART_COUNT`` > 0) runs the same way; the trainer resumes from the newest checkpoint in
the run directory when ``checkpoint.resume`` is true.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from megatron_areal.config import Config
from megatron_areal.launch.checks import check_plan
from megatron_areal.launch.commands import run_paths
from megatron_areal.launch.describe import describe
from megatron_areal.launch.plan import Node, Plan, make_plan
from megatron_areal.launch.procs import Child, ProcessSet, Stopped, supervised
from megatron_areal.launch.registry import LaunchError, clear_registrations, wait_for_servers

logger = logging.getLogger(__name__)


def _scontrol(*args: str) -> str | None:
    """scontrol's output, or None when scontrol is missing or fails (the caller falls back)."""
    try:
        out = subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        logger.debug("scontrol %s: %s", " ".join(args), e)
        return None
    return out.stdout


def expand_hostlist(expr: str) -> list[str]:
    """``gpu[001-003,7],login1`` -> gpu001 gpu002 gpu003 gpu7 login1 (one bracket group per name),
    what ``scontrol show hostnames`` prints; used where scontrol is not installed."""
    names: list[str] = []
    for prefix, body, plain in re.findall(r"([^,\[]+)\[([^\]]+)\][^,]*|([^,\[]+)", expr):
        if plain:
            names.append(plain)
            continue
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{width}d}")
    return names


def gpus_per_node(env: dict[str, str]) -> int:
    """GPUs of each node of the allocation; 0 when the job asked for none."""
    per_node = env.get("SLURM_GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE")
    if per_node:  # "8" or "h100:8"
        return int(per_node.rsplit(":", 1)[-1])
    job_gpus = env.get("SLURM_JOB_GPUS")
    return len(job_gpus.split(",")) if job_gpus else 0


def read_allocation(env: dict[str, str]) -> tuple[list[Node], int]:
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: --slurm must run inside an sbatch job")
    listed = _scontrol("show", "hostnames", nodelist)
    names = listed.split() if listed else expand_hostlist(nodelist)
    # NodeAddr is how other nodes reach a node (on most clusters its name; here, 127.0.0.1)
    shown = _scontrol("-o", "show", "node", ",".join(names)) or ""
    addrs = dict(re.findall(r"NodeName=(\S+).*?NodeAddr=(\S+)", shown))
    return [Node(n, addrs.get(n, n)) for n in names], gpus_per_node(env)


def srun_command(plan: Plan, role: str, nodes: list[str], log_dir: Path, entry: list[str],
                 env: dict[str, str]) -> list[str]:
    cmd = ["srun", f"--job-name={role}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
           f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", "--overlap",
           f"--output={log_dir}/{role}-%N.log", "--open-mode=append"]
    if plan.gpus_per_node:
        cmd.append(f"--gpus-per-node={plan.gpus_per_node}")
    if env.get("SLURM_CPUS_ON_NODE"):  # all cores to the node's role, not the default single CPU
        cmd.append(f"--cpus-per-task={env['SLURM_CPUS_ON_NODE']}")
    return cmd + entry


def _role_entry(role: str, plan_path: Path, config_path: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_areal.launch.node_role", role, "--plan", str(plan_path),
            config_path, *overrides]


def _requeue_on_usr1(_signum: int, _frame: FrameType | None) -> None:
    """``#SBATCH --signal=B:USR1@...``: the time limit is near; put the job back in the queue."""
    job = os.environ.get("SLURM_JOB_ID")
    logger.warning("SIGUSR1: time limit near, requeueing job %s (it resumes from the newest checkpoint)", job)
    if job:
        subprocess.run(["scontrol", "requeue", job], check=False)


def plan_allocation(cfg: Config, eta_explicit: bool, env: dict[str, str]) -> Plan:
    nodes, gpn = read_allocation(env)
    plan = make_plan(nodes, gpn, cfg.cluster, cfg.server, cfg.parallel.tp, cfg.parallel.pp)
    check_plan(plan, cfg, eta_explicit)
    return plan


def run_slurm(cfg: Config, config_path: str, overrides: list[str], eta_explicit: bool) -> int:
    env = dict(os.environ)
    plan = plan_allocation(cfg, eta_explicit, env)
    title = f"job {env.get('SLURM_JOB_ID', '?')} attempt {int(env.get('SLURM_RESTART_COUNT', '0')) + 1}"
    logger.info("%s", describe(plan, title))
    if plan.errors:
        logger.error("the plan fails its checks; nothing was started")
        return 2
    paths = run_paths(cfg.train.run_dir)
    clear_registrations(paths["servers"])
    plan.save(paths["plan"])
    signal.signal(signal.SIGUSR1, _requeue_on_usr1)
    try:
        with supervised(ProcessSet(paths["logs"], cfg.cluster.stop_grace_s)) as procs:
            return _run_steps(plan, cfg, procs, paths, config_path, overrides, env)
    except Stopped as e:
        logger.warning("%s received: stopped both job steps", e)
        return e.code


def _run_steps(plan: Plan, cfg: Config, procs: ProcessSet, paths: dict[str, Path], config_path: str,
               overrides: list[str], env: dict[str, str]) -> int:
    rollout_nodes = plan.nodes_with_role("rollout")
    rollout = procs.start("srun-rollout", srun_command(
        plan, "rollout", rollout_nodes, paths["logs"], _role_entry("rollout", paths["plan"], config_path, overrides),
        env))

    def rollout_died() -> str | None:
        if rollout.returncode() is None:
            return None
        return (f"the rollout step exited with code {rollout.returncode()} before all servers registered; "
                f"see {paths['logs']}/rollout-<node>.log and server-<id>.log. srun said:\n{rollout.log_tail()}")

    wait_for_servers(paths["servers"], list(plan.servers), cfg.server.startup_timeout_s, rollout_died)
    trainer = procs.start("srun-trainer", srun_command(
        plan, "trainer", list(plan.trainer.nodes), paths["logs"],
        _role_entry("trainer", paths["plan"], config_path, overrides), env))
    return _outcome(procs.wait_any(), trainer, paths["logs"])


def _outcome(first: Child, trainer: Child, logs: Path) -> int:
    if first is trainer:
        rc = trainer.returncode() or 0
        (logger.info if rc == 0 else logger.error)("trainer step exited with code %d (logs in %s)", rc, logs)
        return rc
    logger.error("rollout step died (code %s) during training; see %s/rollout-<node>.log:\n%s",
                 first.returncode(), logs, first.log_tail())
    return 1
