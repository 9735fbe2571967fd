"""One node of a run on a cluster without Slurm (Kubernetes, SkyPilot, plain ssh): this node's share of one role,
its place in the run read from the environment that torchrun and Kubernetes provide.

``megatron-areal train CONFIG --node-role {trainer|rollout}`` on every node (``launch/trainer_node.sh``,
``launch/rollout_node.sh``). No batch step sees the whole job, so every node plans the same job from the same
counts and starts what the plan puts on it, with the node agents the Slurm path runs (``node_role``):

=========================================  ======================================================================
``NNODES``, else ``PET_NNODES``, else      nodes of this node's role (Kubeflow's PyTorchJob sets ``WORLD_SIZE``
``WORLD_SIZE``                             and ``PET_NNODES`` to its replicas)
``NODE_RANK``, else ``PET_NODE_RANK``,     this node's index among them (an Indexed Job sets ``JOB_COMPLETION_INDEX``)
``JOB_COMPLETION_INDEX``, else ``RANK``
``MEGATRON_AREAL_TRAINER_NODES``,          the nodes of each role where this node's role is not the one counted
``MEGATRON_AREAL_ROLLOUT_NODES``           (defaults: 1 trainer node; ``cluster.gen_nodes``, at least 1, rollout)
``MASTER_ADDR``, ``MASTER_PORT``           trainer nodes: the first trainer node, the rendezvous
                                           (``cluster.master_port`` when unset)
``MEGATRON_AREAL_NODE_ADDR``, else         the address other nodes reach this node at (servers register it; the
``POD_IP``                                 trainer hosts the weight-update group there); the first trainer node
                                           defaults to ``MASTER_ADDR``, any other to its host name's address
=========================================  ======================================================================

The run directory is on a filesystem every node sees, as under Slurm: rollout servers register there and the
trainer waits for them. The first trainer node writes ``RunDir.plan``; every node runs from its own copy of
the plan, which knows its own address. Rollout nodes run until they are stopped (SIGTERM stops their servers);
a trainer node's exit code is its trainer's.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_areal.config import Config, load_config
from megatron_areal.launch.checks import check_plan
from megatron_areal.launch.node_role import run_rollout, run_trainer_node
from megatron_areal.launch.procs import ProcessSet, Stopped, supervised
from megatron_areal.run.control import checkpoint_on_usr1, clear_requests
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import Node, Plan, make_plan
from megatron_areal.run.secrets import apply_env_api_key, public_overrides
from megatron_areal.rundir.layout import RunDir

logger = logging.getLogger(__name__)

ROLES = ("trainer", "rollout")


@dataclass(frozen=True)
class NodeEnv:
    """What the environment says about this node's place in the run."""

    role: str
    rank: int  # among the nodes of its role
    trainer_nodes: int
    rollout_nodes: int
    master_addr: str
    master_port: int
    addr: str  # this node's

    @property
    def name(self) -> str:
        return node_name(self.role, self.rank)


def node_name(role: str, rank: int) -> str:
    """The plan's name of a node: the same on every node, whatever its host is called."""
    return f"{role}-{rank}"


def _first(env: Mapping[str, str], names: tuple[str, ...], default: str | None = None) -> tuple[str, str | None]:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return names[0], default


def _count(env: Mapping[str, str], names: tuple[str, ...], default: int, minimum: int) -> int:
    name, text = _first(env, names, str(default))
    try:
        value = int(text or "")
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not a whole number") from None
    if value < minimum:
        raise LaunchError(f"{name}={value} must be >= {minimum}")
    return value


def read_node_env(role: str, env: Mapping[str, str], cfg: Config) -> NodeEnv:
    """This node's place in the run, from ``env``; a missing or bad value raises ``LaunchError`` naming it."""
    if role not in ROLES:
        raise LaunchError(f"node role {role!r}: expected one of {', '.join(ROLES)}")
    own = _count(env, ("NNODES", "PET_NNODES", "WORLD_SIZE"), 1, 1)
    default_other = 1 if role == "rollout" else max(cfg.cluster.gen_nodes, 1)
    other = "MEGATRON_AREAL_TRAINER_NODES" if role == "rollout" else "MEGATRON_AREAL_ROLLOUT_NODES"
    counts = {role: own, ("trainer" if role == "rollout" else "rollout"): _count(env, (other,), default_other, 1)}
    for r in ROLES:  # an explicit count of either role wins
        name = f"MEGATRON_AREAL_{r.upper()}_NODES"
        if env.get(name, "").strip():
            counts[r] = _count(env, (name,), 1, 1)
    rank = _count(env, ("NODE_RANK", "PET_NODE_RANK", "JOB_COMPLETION_INDEX", "RANK"), 0, 0)
    if rank >= counts[role]:
        raise LaunchError(f"node rank {rank} is outside the {counts[role]} {role} node(s) of the run")
    _, master_addr = _first(env, ("MASTER_ADDR",))
    if role == "trainer" and not master_addr:
        raise LaunchError("MASTER_ADDR is not set: a trainer node needs the first trainer node's address")
    master_port = _count(env, ("MASTER_PORT",), cfg.cluster.master_port, 1)
    _, addr = _first(env, ("MEGATRON_AREAL_NODE_ADDR", "POD_IP"))
    if not addr:
        addr = master_addr if role == "trainer" and rank == 0 else socket.gethostbyname(socket.gethostname())
    return NodeEnv(role, rank, counts["trainer"], counts["rollout"], master_addr or addr, master_port, addr)


def env_plan(node: NodeEnv, cfg: Config) -> Plan:
    """The run's plan as this node sees it: trainer nodes first, then rollout nodes, every node named by role and
    rank. Only the addresses this node needs are real: its own, and the first trainer node's (the rendezvous)."""
    names = [node_name("trainer", i) for i in range(node.trainer_nodes)]
    names += [node_name("rollout", i) for i in range(node.rollout_nodes)]
    addrs = {names[0]: node.master_addr, node.name: node.addr}
    nodes = [Node(name, addrs.get(name, name)) for name in names]
    cluster = dataclasses.replace(cfg.cluster, gen_nodes=node.rollout_nodes, master_port=node.master_port)
    return make_plan(nodes, cfg.cluster.gpus_per_node, cluster, cfg.server, cfg.parallel.tp, cfg.parallel.pp)


def run_node(cfg: Config, config_path: str, overrides: list[str], role: str, eta_explicit: bool,
             env: Mapping[str, str] | None = None) -> int:
    """Run this node's share of ``role``; returns its exit code. ``overrides`` are the launcher's, with the
    resolved ``model.path``; the node agents read the config with them, as each process of the run does."""
    env = os.environ if env is None else env
    cfg = apply_env_api_key(load_config(config_path, overrides), env)
    node = read_node_env(role, env, cfg)
    plan = env_plan(node, cfg)
    check_plan(plan, cfg, eta_explicit, model_here=True)
    if plan.errors:
        raise LaunchError(f"cannot lay out the run on {node.trainer_nodes} trainer and {node.rollout_nodes} "
                          "rollout node(s):\n  " + "\n  ".join(plan.errors))
    run = RunDir.of(cfg).resolved()
    run.root.mkdir(parents=True, exist_ok=True)
    if node.role == "trainer" and node.rank == 0:
        clear_requests(run.root)
    if role == "rollout":  # an earlier attempt's registrations of this node's servers name dead processes
        for slot in plan.servers_on(node.name):
            (run.servers / slot.id).unlink(missing_ok=True)
    checkpoint_on_usr1(cfg.train.run_dir, f"the {node.name} node")
    logger.info("%s node %d of %d (%s): %s", role, node.rank, getattr(node, f"{role}_nodes"), node.addr,
                ", ".join(s.id for s in plan.servers_on(node.name)) if role == "rollout"
                else f"trainer ranks {node.rank * plan.trainer.nproc_per_node}.."
                     f"{(node.rank + 1) * plan.trainer.nproc_per_node - 1}")
    with tempfile.TemporaryDirectory(prefix="megatron-areal-node-") as local:
        # the first trainer node's plan is the run's; any other node's knows its own address: a node-local copy
        plan_path = run.plan if node.role == "trainer" and node.rank == 0 else RunDir(local).plan
        plan.save(plan_path)
        args = argparse.Namespace(role=role, plan=str(plan_path), config=config_path,
                                  overrides=public_overrides(overrides))
        agent = run_rollout if role == "rollout" else run_trainer_node
        try:
            with supervised(ProcessSet(run.logs, cfg.cluster.stop_grace_s)) as procs:
                return agent(plan, node.name, cfg, args, procs)
        except Stopped as e:
            logger.warning("%s on %s: stopped this node's %s processes", e, node.name, role)
            return e.code
