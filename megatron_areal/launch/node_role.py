"""What ``srun`` runs on each node of a Slurm job: this node's share of one role.

``python -m megatron_areal.launch.node_role {rollout|trainer} --plan RUN_DIR/plan.json CONFIG [k=v ...]``

- rollout: start the servers the plan puts on this node (each on its GPUs, port and log); restart
  one that dies on its port (``server.max_restarts`` times, with backoff; the trainer re-admits it
  at its next weight sync), and exit once none of them is left;
- trainer: run torchrun with this node's rank in the plan's trainer nodes.

On SIGTERM (the batch step stopping, ``scancel``, preemption) every child is stopped first.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

from megatron_areal.config import Config, load_config
from megatron_areal.launch.commands import role_env, server_command, shares_cores, trainer_command
from megatron_areal.launch.heartbeats import TrainerHeartbeats
from megatron_areal.launch.procs import Child, ProcessSet, ServerKeeper, Stopped, supervised
from megatron_areal.launch.server_process import wait_healthy
from megatron_areal.run.control import checkpoint_on_usr1
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import Plan, ServerSlot
from megatron_areal.run.secrets import apply_env_api_key, env_with_api_key
from megatron_areal.rundir.layout import RunDir
from megatron_areal.server.cli import write_registration

logger = logging.getLogger(__name__)


def this_node(plan: Plan) -> str:
    """The plan's name of this node: Slurm's node name, else the host name."""
    for name in (os.environ.get("SLURMD_NODENAME"), socket.gethostname(), socket.gethostname().split(".")[0]):
        if name and any(n.name == name for n in plan.nodes):
            return name
    raise RuntimeError(f"this node ({os.environ.get('SLURMD_NODENAME') or socket.gethostname()}) is not in the "
                       f"plan's nodes {[n.name for n in plan.nodes]}")


def run_rollout(plan: Plan, node: str, cfg: Config, args: argparse.Namespace, procs: ProcessSet) -> int:
    reg = RunDir.of(cfg).resolved().servers
    slots = plan.servers_on(node)
    if not slots:
        raise RuntimeError(f"the plan puts no rollout server on node {node}")
    shared = shares_cores(plan, node, cfg)
    started = [(slot, procs.start(f"server-{slot.id}", server_command(slot, cfg, cfg.model.path, reg),
                                  env_with_api_key(role_env(slot.gpus, False, threads=cfg.server.threads,
                                                            shares_cores=shared),
                                                   cfg.server.api_key))) for slot in slots]
    if cfg.server.engine == "sglang":
        try:
            _register_when_healthy(started, cfg, reg)
        except LaunchError as e:
            logger.error("%s", e)
            return 1
    keeper = ServerKeeper(procs, {child.name: child for _, child in started},
                          {child.name: slot.id for slot, child in started}, cfg.server.max_restarts,
                          cfg.server.restart_backoff_s)
    while keeper.alive():
        keeper.poll()  # a dead server is restarted on its port; the trainer re-admits it at a sync
        time.sleep(0.2)
    # Exit 0: srun's --kill-on-bad-exit would end the other nodes' servers too. The rollout step
    # ends (and the batch step with it) once every node's servers are gone.
    logger.error("every rollout server on node %s died and could not be restarted: %s", node, keeper.summary())
    return 0


def _register_when_healthy(started: list[tuple[ServerSlot, Child]], cfg: Config, reg: Path) -> None:
    """SGLang has no registration of its own: write ``reg/<slot id>`` once its /health answers."""
    for slot, child in started:
        wait_healthy(slot.url, timeout_s=cfg.server.startup_timeout_s, proc=child.popen, log_path=child.log_path)
        write_registration(str(reg), slot.id, {"url": slot.url, "pid": child.pid, "model": cfg.model.path})
        logger.info("registered %s at %s", slot.id, slot.url)


def run_trainer_node(plan: Plan, node: str, cfg: Config, args: argparse.Namespace, procs: ProcessSet) -> int:
    t = plan.trainer
    rank = t.nodes.index(node)
    cmd = trainer_command(plan, rank, args.config, args.overrides, args.plan)
    child = procs.start(f"torchrun-{node}", cmd, role_env(t.gpus, t.world_size == 1, (t.master_addr, t.master_port),
                                                                 threads=cfg.cluster.cpu_threads,
                                                                 allocator=cfg.cluster.cpu_allocator,
                                                                 shares_cores=shares_cores(plan, node, cfg)))
    ranks = range(rank * t.nproc_per_node, (rank + 1) * t.nproc_per_node)
    heartbeats = TrainerHeartbeats(RunDir.of(cfg).resolved().root, ranks, cfg.cluster.progress_timeout_s)
    while procs.first_exited() is None:
        if (stuck := heartbeats.stuck()) is not None:
            logger.error("stopping the trainer on node %s: %s; last lines of %s:\n%s", node, stuck, child.log_path,
                         child.log_tail())
            return 1
        time.sleep(0.5)
    return child.returncode() or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_areal.launch.node_role")
    parser.add_argument("role", choices=["rollout", "trainer"])
    parser.add_argument("--plan", required=True)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    plan = Plan.load(args.plan)
    node = this_node(plan)
    cfg = apply_env_api_key(load_config(args.config, args.overrides))
    # USR1 sent to the job's steps (--signal=USR1@T without B:) lands here
    checkpoint_on_usr1(cfg.train.run_dir, f"the node agent on {node}")
    logs = RunDir.of(cfg).resolved().logs
    run = run_rollout if args.role == "rollout" else run_trainer_node
    try:
        with supervised(ProcessSet(logs, cfg.cluster.stop_grace_s)) as procs:
            return run(plan, node, cfg, args, procs)
    except Stopped as e:
        logger.warning("%s on %s: stopped this node's %s processes", e, node, args.role)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
