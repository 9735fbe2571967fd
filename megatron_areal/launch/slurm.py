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
import time
from pathlib import Path
from types import FrameType

from megatron_areal.config import Config
from megatron_areal.launch.checks import check_plan
from megatron_areal.launch.describe import describe
from megatron_areal.launch.procs import Child, ProcessSet, Stopped, supervised
from megatron_areal.run.control import clear_requests, request_checkpoint, resume_asked, saved_step
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import Node, Plan, make_plan
from megatron_areal.run.registry import clear_registrations, wait_for_servers
from megatron_areal.run.secrets import apply_env_api_key, env_with_api_key, public_overrides
from megatron_areal.rundir.layout import RunDir
from megatron_areal.util.run_identity import NONCE_ENV, new_nonce

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


class RequeueOnUsr1:
    """``#SBATCH --signal=B:USR1@T``: the time limit is T seconds away. Requeueing at once would lose
    every step since the last periodic checkpoint, so USR1 only asks the trainer (through
    ``RUN_DIR/control/checkpoint``) to save at its next step boundary and stop; the job requeues when
    the trainer has answered, or when ``grace_s`` has passed without an answer (capped at the job's
    time left minus a minute), or at once when no trainer runs yet. The next attempt resumes from the
    newest checkpoint."""

    def __init__(self, run_dir: Path, grace_s: float, job: str | None) -> None:
        self.run_dir, self.grace_s, self.job = run_dir, grace_s, job
        self.deadline: float | None = None

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        if self.deadline is not None:
            return
        left = time_left_s(self.job)
        grace = self.grace_s if left is None else max(0.0, min(self.grace_s, left - 60))
        self.deadline = time.monotonic() + grace
        request_checkpoint(self.run_dir, f"SIGUSR1 to the batch step of job {self.job}")
        logger.warning("SIGUSR1: time limit near; asked the trainer for a checkpoint at its next step boundary "
                       "(requeueing job %s once it is saved, within %.0f s)", self.job, grace)

    @property
    def asked(self) -> bool:
        return self.deadline is not None

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def requeue(self, why: str) -> None:
        logger.warning("requeueing job %s: %s; the next attempt resumes from the newest checkpoint", self.job, why)
        if self.job:
            subprocess.run(["scontrol", "requeue", self.job], check=False)


def time_left_s(job: str | None) -> float | None:
    """Seconds until the job's time limit (``squeue -o %L``: ``[D-]HH:MM:SS``, ``MM:SS``); None if unknown."""
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(out.stdout.strip())


def parse_time_left(text: str) -> float | None:
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None  # UNLIMITED, INVALID, empty
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


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
    run = RunDir.of(cfg).resolved()
    clear_registrations(run.servers)
    clear_requests(run.root)
    plan.save(run.plan)
    apply_env_api_key(cfg, env)
    env = env_with_api_key(env, cfg.server.api_key)  # srun hands the environment to every node
    if cfg.server.engine in ("embedded", "vllm"):  # servers that answer /run_identity (SGLang serves no such route)
        env[NONCE_ENV] = new_nonce()
    usr1 = RequeueOnUsr1(run.root, cfg.cluster.requeue_grace_s, env.get("SLURM_JOB_ID"))
    usr1.install()
    try:
        with supervised(ProcessSet(run.logs, cfg.cluster.stop_grace_s)) as procs:
            rc = _run_steps(plan, cfg, procs, run, config_path, public_overrides(overrides), env, usr1)
    except Stopped as e:
        logger.warning("%s received: stopped both job steps", e)
        return e.code
    except LaunchError as e:
        if not usr1.asked:
            raise
        logger.error("%s", e)
        rc = None
    return _requeue_if_asked(usr1, rc, run.root)


def _requeue_if_asked(usr1: RequeueOnUsr1, rc: int | None, run_dir: Path) -> int:
    """After both steps stopped: requeue when USR1 asked for it, or when the trainer saved a checkpoint
    and asked to be resumed. ``rc`` is the trainer step's code, or None when it was not waited for (no
    trainer yet, or no answer in time)."""
    resume = resume_asked(run_dir)
    if resume is not None:
        usr1.requeue(f"the trainer saved step {resume.get('step')} and stopped: {resume.get('reason')}")
        return 0
    if not usr1.asked:
        return rc or 0
    step = saved_step(run_dir)
    if step is not None:
        usr1.requeue(f"the trainer saved a checkpoint at step {step} and stopped")
        return 0
    if rc == 0:
        logger.info("SIGUSR1 arrived, but the trainer finished every step first: not requeueing")
        return 0
    usr1.requeue("the trainer did not save a checkpoint in time" if rc is None else
                 f"the trainer step exited with code {rc} before saving")
    return 0


def _run_steps(plan: Plan, cfg: Config, procs: ProcessSet, run: RunDir, config_path: str,
               overrides: list[str], env: dict[str, str], usr1: RequeueOnUsr1) -> int | None:
    rollout_nodes = plan.nodes_with_role("rollout")
    rollout = procs.start("srun-rollout", srun_command(
        plan, "rollout", rollout_nodes, run.logs, _role_entry("rollout", run.plan, config_path, overrides),
        env), env)

    def rollout_died() -> str | None:
        if usr1.asked:
            return "SIGUSR1 arrived before the trainer started: nothing to checkpoint"
        if rollout.returncode() is None:
            return None
        return (f"the rollout step exited with code {rollout.returncode()} before all servers registered; "
                f"see {run.logs}/rollout-<node>.log and server-<id>.log. srun said:\n{rollout.log_tail()}")

    wait_for_servers(run.servers, list(plan.servers), cfg.server.startup_timeout_s, rollout_died,
                     nonce=env.get(NONCE_ENV))
    trainer = procs.start("srun-trainer", srun_command(
        plan, "trainer", list(plan.trainer.nodes), run.logs,
        _role_entry("trainer", run.plan, config_path, overrides), env), env)
    first = _wait_unless_overdue(procs, usr1)
    return None if first is None else _outcome(first, trainer, run.logs)


def _wait_unless_overdue(procs: ProcessSet, usr1: RequeueOnUsr1, poll_s: float = 0.2) -> Child | None:
    """The first step to exit, or None when a USR1 request went unanswered past its deadline."""
    while (first := procs.first_exited()) is None:
        if usr1.overdue():
            return None
        time.sleep(poll_s)
    return first


def _outcome(first: Child, trainer: Child, logs: Path) -> int:
    if first is trainer:
        rc = trainer.returncode() or 0
        (logger.info if rc == 0 else logger.error)("trainer step exited with code %d (logs in %s)", rc, logs)
        return rc
    logger.error("rollout step ended (code %s) during training: its servers died past server.max_restarts "
                 "restarts; see %s/rollout-<node>.log:\n%s",
                 first.returncode(), logs, first.log_tail())
    return 1
