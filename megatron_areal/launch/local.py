"""Everything on one machine: servers, then the trainer; on Ctrl-C or any failure, stop them all.

A server that dies while the trainer runs is started again on its port (``server.max_restarts``
times, with backoff); the trainer re-admits it at its next weight sync. The run stops only when
no server is left.

Another job on the machine: the run claims every port it plans (``launch/ports.py``) and moves off one that
another run claimed or any process listens on, checks the rendezvous port again just before the trainer
starts, admits only servers that prove they hold this run's nonce (``util/run_identity.py``), and when the
trainer fails on a port another process took, its last line names the port. A trainer whose heartbeat
stops for ``cluster.progress_timeout_s`` ends the run, named."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace
from pathlib import Path

import psutil

from megatron_areal.config import Config
from megatron_areal.launch.commands import role_env, server_command, shares_cores, trainer_command
from megatron_areal.launch.describe import describe
from megatron_areal.launch.heartbeats import TrainerHeartbeats
from megatron_areal.launch.ports import PortClaims, taken_by
from megatron_areal.launch.procs import Child, ProcessSet, ServerKeeper, Stopped, supervised
from megatron_areal.launch.progress import RunProgress
from megatron_areal.launch.server_watch import ServerWatch
from megatron_areal.run.control import clear_requests
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import Node, Plan, make_plan
from megatron_areal.run.registry import clear_registrations, wait_for_servers
from megatron_areal.run.secrets import apply_env_api_key, env_with_api_key, public_overrides
from megatron_areal.rundir.layout import RunDir
from megatron_areal.util.netutil import port_free
from megatron_areal.util.run_identity import NONCE_ENV, new_nonce

logger = logging.getLogger(__name__)


def with_free_ports(plan: Plan, claims: PortClaims) -> Plan:
    """Claim every planned port for this run, moving any that another run claimed or a process listens on to a
    free one (and say so)."""
    taken: set[int] = set()
    servers = []
    for slot in plan.servers:
        port = slot.port
        if port in taken or not claims.usable(slot.addr, port):
            port = claims.pick(slot.addr, taken)
            logger.warning("port %d is busy%s; server %s uses %d instead", slot.port, taken_by(slot.port), slot.id,
                           port)
        taken.add(port)
        servers.append(replace(slot, port=port))
    t = plan.trainer
    master = t.master_port
    if master in taken or not claims.usable(t.master_addr, master):
        master = claims.pick(t.master_addr, taken)
        logger.warning("port %d is busy%s; the trainer rendezvous uses %d instead", t.master_port,
                       taken_by(t.master_port), master)
    return replace(plan, servers=tuple(servers), trainer=replace(t, master_port=master))


def local_plan(cfg: Config, claims: PortClaims | None = None) -> Plan:
    """The plan for this machine, its ports claimed in ``claims`` (held by the caller for the run's life)."""
    node = Node(socket.gethostname(), cfg.server.host)
    plan = make_plan([node], cfg.cluster.gpus_per_node, cfg.cluster, cfg.server, cfg.parallel.tp, cfg.parallel.pp)
    if plan.errors:
        raise LaunchError("cannot lay out this run on one machine:\n  " + "\n  ".join(plan.errors))
    return with_free_ports(plan, claims if claims is not None else PortClaims())


def rendezvous_still_free(plan: Plan, claims: PortClaims, plan_path: Path) -> Plan:
    """The plan with a rendezvous port nothing listens on right before the trainer starts: a port taken since
    planning (by a process that is no run of ours) is moved, and the plan saved again."""
    t = plan.trainer
    if port_free(t.master_addr, t.master_port):
        return plan
    master = claims.pick(t.master_addr, {s.port for s in plan.servers})
    logger.warning("the trainer's rendezvous port %d was taken since planning%s; using %d instead", t.master_port,
                   taken_by(t.master_port), master)
    plan = replace(plan, trainer=replace(t, master_port=master))
    plan.save(plan_path)
    return plan


def run_local(cfg: Config, config_path: str, overrides: list[str], model_dir: str) -> int:
    """Run the job on this machine; returns the trainer's exit code (non-zero on any failure)."""
    run = RunDir.of(cfg).resolved()
    clear_registrations(run.servers)
    clear_requests(run.root)
    apply_env_api_key(cfg)
    overrides = public_overrides(overrides)
    claims = PortClaims()
    try:
        plan = local_plan(cfg, claims)
        plan.save(run.plan)
        logger.info("%s", describe(plan, "this machine"))
        with supervised(ProcessSet(run.logs, cfg.cluster.stop_grace_s)) as procs:
            return _supervise(plan, cfg, procs, run, overrides, config_path, model_dir, claims)
    except Stopped as e:
        logger.warning("%s received: stopped every process of the run", e)
        return e.code
    finally:
        claims.release()


def _supervise(plan: Plan, cfg: Config, procs: ProcessSet, run: RunDir, overrides: list[str],
               config_path: str, model_dir: str, claims: PortClaims) -> int:
    servers = {}
    shared = shares_cores(plan, plan.nodes[0].name, cfg)
    # SGLang serves no /run_identity: its servers are admitted by address, as before
    identity = {NONCE_ENV: new_nonce()} if cfg.server.engine in ("embedded", "vllm") else {}
    for i, slot in enumerate(plan.servers):
        name = f"server-{i}"
        servers[name] = slot
        env = role_env(slot.gpus, False, threads=cfg.server.threads, shares_cores=shared)
        procs.start(name, server_command(slot, cfg, model_dir, run.servers),
                    env_with_api_key({**env, **identity}, cfg.server.api_key))

    def dead_server() -> str | None:
        for c in procs.exited():
            slot = servers[c.name]
            held = "" if port_free(slot.addr, slot.port) else \
                f" (its port {slot.addr}:{slot.port} is held by another process{taken_by(slot.port)})"
            return (f"server {slot.id} exited with code {c.returncode()} before registering{held}; "
                    f"last lines of {c.log_path}:\n{c.log_tail()}")
        return None

    wait_for_servers(run.servers, list(plan.servers), cfg.server.startup_timeout_s, dead_server,
                     nonce=identity.get(NONCE_ENV))
    if (dead := dead_server()) is not None:
        raise LaunchError(dead)
    plan = rendezvous_still_free(plan, claims, run.plan)
    t = plan.trainer
    cmd = trainer_command(plan, 0, config_path, overrides, run.plan)
    env = role_env(t.gpus, t.world_size == 1, (t.master_addr, t.master_port), threads=cfg.cluster.cpu_threads,
                   allocator=cfg.cluster.cpu_allocator, shares_cores=shared)
    trainer = procs.start("trainer", cmd, env_with_api_key({**env, **identity}, cfg.server.api_key))
    keeper = ServerKeeper(procs, {c.name: c for c in procs.children if c.name in servers},
                          {name: slot.id for name, slot in servers.items()}, cfg.server.max_restarts,
                          cfg.server.restart_backoff_s)
    progress = RunProgress(cfg.train.run_dir, cfg.train.steps)
    heartbeats = TrainerHeartbeats(run.root, range(t.nproc_per_node), cfg.cluster.progress_timeout_s)
    watch = ServerWatch(keeper, servers, identity[NONCE_ENV], cfg.cluster.progress_timeout_s,
                        cfg.server.startup_timeout_s).start() if identity else None
    try:
        return _until_trainer_exits(trainer, keeper, watch, heartbeats, progress, plan, procs)
    finally:
        if watch is not None:
            watch.stop()


def _until_trainer_exits(trainer: Child, keeper: ServerKeeper, watch: ServerWatch | None,
                         heartbeats: TrainerHeartbeats, progress: RunProgress, plan: Plan, procs: ProcessSet) -> int:
    while trainer.returncode() is None:
        for line in progress.poll():
            logger.info("%s", line)
        keeper.poll()  # a dead server is restarted on its port; the trainer re-admits it at a sync
        if keeper.alive() == 0:
            logger.error("every rollout server died and none could be restarted (%s); stopping the run",
                         keeper.summary())
            return 1
        for name, why in watch.stalled() if watch is not None else ():
            logger.error("%s: killing it (the keeper restarts it or gives it up)", why)
            procs.kill(keeper.servers[name])
        if (stuck := heartbeats.stuck()) is not None:
            logger.error("%s; last lines of %s:\n%s", stuck, trainer.log_path, trainer.log_tail())
            logger.error("stopping the run: the trainer (pid %d) has stopped making progress: %s", trainer.pid, stuck)
            return 1
        time.sleep(0.2)
    if keeper.total_restarts or keeper.given_up:
        logger.warning("%s", keeper.summary())
    rc = trainer.returncode() or 0
    for line in progress.poll():
        logger.info("%s", line)
    if rc != 0:
        logger.error("the trainer failed; last lines of %s:\n%s", trainer.log_path, trainer.log_tail(15))
    (logger.info if rc == 0 else logger.error)("trainer exited with code %d (log %s)%s", rc, trainer.log_path,
                                               "" if rc == 0 else _port_reason(plan))
    if rc == 0:
        # the command's wall time, model preparation and both evaluations included
        logger.info("%s", progress.summary(time.time() - psutil.Process().create_time()))
    return rc


def _port_reason(plan: Plan) -> str:
    """"; its rendezvous port ... is held by another process" when that is so after the trainer failed."""
    t = plan.trainer
    if port_free(t.master_addr, t.master_port):
        return ""
    return (f": its rendezvous port {t.master_addr}:{t.master_port} (cluster.master_port) is held by another "
            f"process{taken_by(t.master_port)}")

