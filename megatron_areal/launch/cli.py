"""``megatron-areal train CONFIG.yaml [key=value ...]``: the main job.

- ``--dry-run [--nodes N --gpus-per-node G]``: print the placement and the checks; start nothing.
- ``--slurm``: the batch step of an sbatch job (what ``slurm/*.sh`` run): srun each role.
- ``--node-role trainer|rollout``: one node of a run without Slurm (what ``launch/*_node.sh`` run), placed by
  the environment (``launch/env_node.py``).
- otherwise: everything on this machine (servers, then the trainer), stopped together on Ctrl-C.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_areal.config import Config, ConfigError, load_config
from megatron_areal.configbase import load_yaml, parse_override
from megatron_areal.launch.checks import check_plan
from megatron_areal.launch.describe import describe
from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import make_plan, synthetic_nodes

logger = logging.getLogger(__name__)


def eta_is_explicit(config_path: str, overrides: list[str]) -> bool:
    """Whether the run chose its staleness bound (the default is not a choice a cluster run should inherit)."""
    if any(parse_override(o)[0] == ["staleness", "eta"] for o in overrides):
        return True
    staleness = load_yaml(config_path).get("staleness")
    return isinstance(staleness, dict) and "eta" in staleness


def dry_run(cfg: Config, args: argparse.Namespace) -> int:
    in_allocation = args.nodes is None and bool(os.environ.get("SLURM_JOB_NODELIST"))
    if in_allocation:
        from megatron_areal.launch.slurm import read_allocation
        nodes, gpn = read_allocation(dict(os.environ))
    else:
        nodes = synthetic_nodes(args.nodes or cfg.cluster.nodes)
        gpn = cfg.cluster.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    plan = make_plan(nodes, gpn, cfg.cluster, cfg.server, cfg.parallel.tp, cfg.parallel.pp)
    # inside the allocation the job starts from this filesystem, so its model must be here
    check_plan(plan, cfg, eta_is_explicit(args.config, args.overrides), model_here=in_allocation)
    plan.warnings.extend(busy_here(cfg))
    print(describe(plan, args.config))
    from megatron_areal.launch.weight_plan import describe_weight_push
    print(describe_weight_push(cfg, plan))
    return 0 if plan.ok else 1


def busy_here(cfg: Config) -> list[str]:
    """Warnings for configured ports something on this machine listens on now: a run started here moves off
    them (``launch/local.py``), a Slurm job's nodes are other machines."""
    from megatron_areal.launch.ports import taken_by
    from megatron_areal.util.netutil import port_free

    host = cfg.server.host
    ports = {"cluster.master_port": cfg.cluster.master_port}
    for k in range(cfg.server.count):
        ports[f"server {k} (server.base_port + {k} x cluster.server_port_stride)"] = (
            cfg.server.base_port + k * cfg.cluster.server_port_stride)
    return [f"port {port} ({what}) is busy on this machine now{taken_by(port)}: a run started here moves off it"
            for what, port in ports.items() if 0 < port < 65536 and not port_free(host, port)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-areal train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the run's YAML config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--dry-run", action="store_true", help="print the launch plan and its checks; start nothing")
    p.add_argument("--nodes", type=int, help="nodes to plan for (--dry-run outside an allocation)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node to plan for (--dry-run)")
    p.add_argument("--slurm", action="store_true", help="run as the batch step of an sbatch job")
    p.add_argument("--node-role", choices=["trainer", "rollout"],
                   help="run this node's share of one role of a multi-node run without Slurm, placed by the "
                        "environment (NNODES, NODE_RANK, MASTER_ADDR, ...: README, Clusters without Slurm)")
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.nodes is not None and args.nodes < 1 or args.gpus_per_node is not None and args.gpus_per_node < 0:
        parser.error("--nodes must be >= 1 and --gpus-per-node >= 0")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            return dry_run(cfg, args)
        from megatron_areal.launch.commands import resolved_model_path
        model_dir = resolved_model_path(cfg)  # once, for servers and trainer alike
        overrides = [*args.overrides, f"model.path={model_dir}"]
        if args.node_role:
            from megatron_areal.launch.env_node import run_node
            return run_node(cfg, args.config, overrides, args.node_role, eta_is_explicit(args.config, args.overrides))
        if args.slurm:
            from megatron_areal.launch.slurm import run_slurm
            return run_slurm(cfg, args.config, overrides, eta_is_explicit(args.config, args.overrides))
        from megatron_areal.launch.local import run_local
        if cfg.cluster.nodes > 1:
            logger.warning("cluster.nodes = %d applies to Slurm and --dry-run; running on this machine",
                           cfg.cluster.nodes)
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
        return run_local(cfg, args.config, overrides, model_dir)
    except ConfigError as e:
        if args.dry_run:  # the dry run's report goes to stdout, failed checks included
            print(f"checks: 1 FAILED\n  FAILED: config: {e}")
        else:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    except (LaunchError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 1
