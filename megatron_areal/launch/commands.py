"""Command lines and environments of the roles, shared by the local launcher and Slurm.

- a rollout server: ``megatron-areal serve`` (embedded engine) or the SGLang launcher, bound to
  the address the plan gives it and registering into ``RUN_DIR/servers``;
- a trainer node: ``torch.distributed.run`` over ``megatron_areal.trainer`` (a single
  plain process when the whole trainer is one rank).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_areal.config import Config
from megatron_areal.configbase import load_yaml, parse_override
from megatron_areal.launch.allocator import with_allocator
from megatron_areal.launch.sglang import SGLangLaunch
from megatron_areal.launch.vllm import VLLMLaunch, launcher_command
from megatron_areal.run.plan import Plan, ServerSlot
from megatron_areal.util.compute_dtype import cpu_dtype_name


def resolved_model_path(cfg: Config) -> str:
    """``model.path`` as the absolute folder every role loads, resolved once by the launcher.

    A built-in name is prepared here (so servers and trainer ranks never race to prepare it), and a
    relative path is made absolute: SGLang reads a path that is not a folder in its own working
    directory as a model-hub id, while the trainer would fail on it."""
    from megatron_areal.model.assets import resolve_model
    return str(resolve_model(cfg.model.path).absolute())


def context_length(cfg: Config) -> int:
    """Tokens per sequence a rollout server is set up for: ``server.context_length``, else
    ``model.max_seq_len`` (the longest sequence the trainer accepts)."""
    return cfg.server.context_length or cfg.model.max_seq_len


def sglang_spec(slot: ServerSlot, cfg: Config, model_dir: str) -> SGLangLaunch:
    """The SGLang server of one slot of the plan; ``server.extra_args`` last, after
    ``--enable-return-routed-experts`` when the rollout asks for routed experts."""
    routes = ("--enable-return-routed-experts",) if cfg.rollout.return_routed_experts else ()
    return SGLangLaunch(model_path=model_dir, port=slot.port, host=slot.addr, tp=cfg.server.tp,
                        mem_fraction=cfg.server.mem_fraction, api_key=cfg.server.api_key, seed=cfg.train.seed,
                        context_length=context_length(cfg), max_running=cfg.server.max_running,
                        extra_args=(*routes, *cfg.server.extra_args))


def vllm_spec(slot: ServerSlot, cfg: Config, model_dir: str) -> VLLMLaunch:
    """The vLLM server of one slot of the plan, run by ``server.python`` (its own environment). On a CPU it
    computes in the trainer's dtype: fp32 for ``auto``, and for bf16 where this CPU has no native bf16
    (``compute_dtype``; built on the server's own node, ``launch/node_role.py``)."""
    gpu = bool(slot.gpus)
    if gpu:
        dtype = cfg.model.dtype
    else:
        dtype = cpu_dtype_name("float32" if cfg.model.dtype == "auto" else cfg.model.dtype, "model.dtype")
    return VLLMLaunch(model_path=model_dir, port=slot.port, host=slot.addr, tp=cfg.server.tp, gpu=gpu, dtype=dtype,
                      context_length=context_length(cfg), max_running=cfg.server.max_running, seed=cfg.train.seed,
                      threads=cfg.server.threads, mem_fraction=cfg.server.mem_fraction, enforce_eager=not gpu,
                      enable_return_routed_experts=cfg.rollout.return_routed_experts,
                      extra_args=tuple(cfg.server.extra_args), python=cfg.server.python or sys.executable)


def server_command(slot: ServerSlot, cfg: Config, model_dir: str, reg_dir: Path) -> list[str]:
    """SGLang does not register itself: the node role registers it once healthy. The embedded server
    registers under the slot's id, so the wait matches it by name; so does vLLM, through the wrapper
    that starts it (``launch/vllm.exec_server``)."""
    if cfg.server.engine == "sglang":
        return sglang_spec(slot, cfg, model_dir).command(cfg.server.python or sys.executable)
    if cfg.server.engine == "vllm":
        return launcher_command(vllm_spec(slot, cfg, model_dir), register_dir=str(reg_dir), server_id=slot.id)
    cmd = [sys.executable, "-m", "megatron_areal.cli", "serve", "--model", model_dir, "--host", slot.addr,
           "--port", str(slot.port), "--register-dir", str(reg_dir), "--server-id", slot.id,
           "--max-running", str(cfg.server.max_running), "--max-queue", str(cfg.server.max_queue),
           "--context-length", str(context_length(cfg)), "--seed", str(cfg.train.seed)]
    if slot.gpus:
        cmd += ["--device", "cuda"]
    if cfg.model.dtype != "auto":
        cmd += ["--dtype", cfg.model.dtype]
    return cmd  # the API key travels in the environment (run/secrets.py), never in argv


def weight_group_address(plan: Plan, node_rank: int, config_path: str, overrides: list[str]) -> list[str]:
    """``weights.master_address`` for the trainer ranks of node ``node_rank``: that node's address in
    the plan. Pipeline stage heads host the weight-update groups the servers join, and with PP > 1
    they sit on different trainer nodes, so each node passes its own address. The host's resolver is
    no substitute (Debian maps the host name to 127.0.1.1). An address the user set wins."""
    sections = ("weights", "realloc")  # "realloc" is the section's old name, still read
    if any(parse_override(o)[0] in [[s, "master_address"] for s in sections] for o in overrides):
        return []
    data = load_yaml(config_path)
    if any(isinstance(data.get(s), dict) and data[s].get("master_address") for s in sections):
        return []
    return [f"weights.master_address={plan.node(plan.trainer.nodes[node_rank]).addr}"]


def trainer_command(plan: Plan, node_rank: int, config_path: str, overrides: list[str], plan_path: Path) -> list[str]:
    overrides = [*weight_group_address(plan, node_rank, config_path, overrides), *overrides]
    entry = ["-m", "megatron_areal.trainer", "--plan", str(plan_path), config_path, *overrides]
    t = plan.trainer
    if t.world_size == 1:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(t.nodes)}", f"--node-rank={node_rank}",
            f"--nproc-per-node={t.nproc_per_node}", f"--master-addr={t.master_addr}",
            f"--master-port={t.master_port}", *entry]


def visible_devices(local: tuple[int, ...], env: dict[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for local GPU indices, relative to what Slurm already made visible."""
    if not local:
        return None
    base = env.get("CUDA_VISIBLE_DEVICES")
    ids = base.split(",") if base else [str(i) for i in range(max(local) + 1)]
    if max(local) >= len(ids):
        raise ValueError(f"GPU {max(local)} requested but only {len(ids)} are visible ({base})")
    return ",".join(ids[i] for i in local)


def cpu_thread_env(threads: int, env: dict[str, str] | None = None, *, shares_cores: bool) -> dict[str, str]:
    """Thread settings of a CPU role: ``threads`` torch threads, and where the roles on the machine ask
    for more threads than it has cores (``shares_cores``), OpenMP threads that sleep at a barrier
    instead of spinning (``OMP_WAIT_POLICY=PASSIVE``). ``env`` (default: this process's) may set a
    policy of its own, which is kept.

    Shared cores: while a trainer's threads spin waiting for one that lost its core to a server, the
    server gets less of that core and the trainer waits longer; on two cores, a two-thread and a
    one-thread process sharing them ran 40% and 24% faster passive than spinning. Cores of its own:
    sleeping costs a wake-up per parallel region, and a decode step has hundreds; a two-thread server
    alone on two cores decoded bench/serve.py's workload in 37.5-37.7 s spinning, 51-68 s passive.
    """
    out = {"OMP_NUM_THREADS": str(threads)}
    policy = (env if env is not None else os.environ).get("OMP_WAIT_POLICY")
    if policy or shares_cores:
        out["OMP_WAIT_POLICY"] = policy or "PASSIVE"
    return out


def shares_cores(plan: Plan, node: str, cfg: Config) -> bool:
    """Whether the CPU roles on ``node`` that compute at the same time ask for more threads than this
    machine has cores: all of them where generation overlaps training, but a synchronous run
    (``staleness.overlap: false``) generates and trains in turn, so its servers and its trainer each
    have the cores to themselves."""
    servers = plan.cpu_threads_on(node, cfg.server.threads, 0)
    trainer = plan.cpu_threads_on(node, 0, cfg.cluster.cpu_threads)
    at_once = servers + trainer if cfg.staleness.overlap else max(servers, trainer)
    return at_once > usable_cores()


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, which Slurm and containers narrow)."""
    return len(os.sched_getaffinity(0))


def role_env(gpus: tuple[int, ...], single_rank: bool, master: tuple[str, int] | None = None,
             threads: int | None = None, allocator: str = "glibc", shares_cores: bool = True) -> dict[str, str]:
    """Environment of a role. ``threads`` pins torch's CPU threads of a CPU role, so that servers
    and trainer ranks sharing a machine divide its cores instead of oversubscribing them
    (``shares_cores``: whether the node's CPU roles that compute at the same time ask for more threads
    than it has cores); ``allocator`` (``cluster.cpu_allocator``) may preload mimalloc into a
    CPU role (launch/allocator.py)."""
    env = dict(os.environ) if gpus else with_allocator(dict(os.environ), allocator)
    devices = visible_devices(gpus, env)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if threads is not None and not gpus:
        env.update(cpu_thread_env(threads, env, shares_cores=shares_cores))
    if single_rank and master is not None:  # what torchrun would set for a world of one
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    return env
