"""Entry point of every trainer rank (run under torchrun, or alone for a world of one).

``python -m megatron_areal.launch.trainer_main --plan RUN_DIR/plan.json CONFIG [key=value ...]``
waits for the rollout servers of the plan to register, then hands over to the training loop.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_areal.config import load_config
from megatron_areal.launch.commands import run_paths
from megatron_areal.launch.plan import Plan
from megatron_areal.launch.registry import wait_for_servers

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_areal.launch.trainer_main")
    parser.add_argument("--plan", required=True, help="RUN_DIR/plan.json written by the launcher")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    cfg = load_config(args.config, args.overrides)
    plan = Plan.load(args.plan)
    urls = wait_for_servers(run_paths(cfg.train.run_dir)["servers"], list(plan.servers),
                            cfg.server.startup_timeout_s)
    from megatron_areal.trainer import run_trainer  # heavy (Megatron); imported once the servers are up

    run_trainer(cfg, urls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
