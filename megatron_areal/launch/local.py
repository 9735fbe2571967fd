"""Everything on one machine: servers, then the trainer; on Ctrl-C or any failure, stop them all.

A server that dies while the trainer runs is started again on its port (``server.max_restarts``
times, with backoff); the trainer re-admits it at its next weight sync. The run stops only when
no server is left."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace

import psutil

from megatron_areal.config import Config
from megatron_areal.launch.commands import role_env, server_command, shares_cores, trainer_command
from megatron_areal.launch.describe import describe
from megatron_areal.launch.procs import ProcessSet, ServerKeeper, Stopped, supervised
from megatron_areal.launch.progress import RunProgress
from megatron_areal.run.control import clear_requests
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import Node, Plan, make_plan
from megatron_areal.run.registry import clear_registrations, wait_for_servers
from megatron_areal.run.secrets import apply_env_api_key, env_with_api_key, public_overrides
from megatron_areal.rundir.layout import RunDir
from megatron_areal.util.netutil import free_port, port_free

logger = logging.getLogger(__name__)


def with_free_ports(plan: Plan) -> Plan:
    """Move any planned port that is taken on this machine to a free one (and say so)."""
    taken: set[int] = set()
    servers = []
    for slot in plan.servers:
        port = slot.port
        if port in taken or not port_free(slot.addr, port):
            port = free_port(slot.addr, taken)
            logger.warning("port %d is busy; server %s uses %d instead", slot.port, slot.id, port)
        taken.add(port)
        servers.append(replace(slot, port=port))
    t = plan.trainer
    master = t.master_port
    if master in taken or not port_free(t.master_addr, master):
        master = free_port(t.master_addr, taken)
        logger.warning("port %d is busy; the trainer rendezvous uses %d instead", t.master_port, master)
    return replace(plan, servers=tuple(servers), trainer=replace(t, master_port=master))


def local_plan(cfg: Config) -> Plan:
    node = Node(socket.gethostname(), cfg.server.host)
    plan = make_plan([node], cfg.cluster.gpus_per_node, cfg.cluster, cfg.server, cfg.parallel.tp, cfg.parallel.pp)
    if plan.errors:
        raise LaunchError("cannot lay out this run on one machine:\n  " + "\n  ".join(plan.errors))
    return with_free_ports(plan)


def run_local(cfg: Config, config_path: str, overrides: list[str], model_dir: str) -> int:
    """Run the job on this machine; returns the trainer's exit code (non-zero on any failure)."""
    run = RunDir.of(cfg).resolved()
    clear_registrations(run.servers)
    clear_requests(run.root)
    apply_env_api_key(cfg)
    overrides = public_overrides(overrides)
    plan = local_plan(cfg)
    plan.save(run.plan)
    logger.info("%s", describe(plan, "this machine"))
    try:
        with supervised(ProcessSet(run.logs, cfg.cluster.stop_grace_s)) as procs:
            return _supervise(plan, cfg, procs, run, overrides, config_path, model_dir)
    except Stopped as e:
        logger.warning("%s received: stopped every process of the run", e)
        return e.code


def _supervise(plan: Plan, cfg: Config, procs: ProcessSet, run: RunDir, overrides: list[str],
               config_path: str, model_dir: str) -> int:
    servers = {}
    shared = shares_cores(plan, plan.nodes[0].name, cfg)
    for i, slot in enumerate(plan.servers):
        name = f"server-{i}"
        servers[name] = slot
        procs.start(name, server_command(slot, cfg, model_dir, run.servers),
                    env_with_api_key(role_env(slot.gpus, False, threads=cfg.server.threads, shares_cores=shared),
                                     cfg.server.api_key))

    def dead_server() -> str | None:
        for c in procs.exited():
            return (f"server {servers[c.name].id} exited with code {c.returncode()} before registering; "
                    f"last lines of {c.log_path}:\n{c.log_tail()}")
        return None

    wait_for_servers(run.servers, list(plan.servers), cfg.server.startup_timeout_s, dead_server)
    t = plan.trainer
    cmd = trainer_command(plan, 0, config_path, overrides, run.plan)
    env = role_env(t.gpus, t.world_size == 1, (t.master_addr, t.master_port), threads=cfg.cluster.cpu_threads,
                   allocator=cfg.cluster.cpu_allocator, shares_cores=shared)
    trainer = procs.start("trainer", cmd, env_with_api_key(env, cfg.server.api_key))
    keeper = ServerKeeper(procs, {c.name: c for c in procs.children if c.name in servers},
                          {name: slot.id for name, slot in servers.items()}, cfg.server.max_restarts,
                          cfg.server.restart_backoff_s)
    progress = RunProgress(cfg.train.run_dir, cfg.train.steps)
    while trainer.returncode() is None:
        for line in progress.poll():
            logger.info("%s", line)
        keeper.poll()  # a dead server is restarted on its port; the trainer re-admits it at a sync
        if keeper.alive() == 0:
            logger.error("every rollout server died and none could be restarted (%s); stopping the run",
                         keeper.summary())
            return 1
        time.sleep(0.2)
    if keeper.total_restarts or keeper.given_up:
        logger.warning("%s", keeper.summary())
    rc = trainer.returncode() or 0
    for line in progress.poll():
        logger.info("%s", line)
    (logger.info if rc == 0 else logger.error)("trainer exited with code %d (log %s)", rc, trainer.log_path)
    if rc == 0:
        # the command's wall time, model preparation and both evaluations included
        logger.info("%s", progress.summary(time.time() - psutil.Process().create_time()))
    return rc
