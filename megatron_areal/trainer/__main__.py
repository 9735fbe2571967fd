"""Entry point of every trainer rank (run under torchrun, or alone for a world of one).

``python -m megatron_areal.trainer --plan RUN_DIR/plan.json CONFIG [key=value ...]``
checks that the installed megatron-core is the one our changes to it are written against
(``patches/upstream.py``; a mismatch stops the rank with an error naming it), waits for the rollout servers
of the plan to register, then hands over to the training loop. The API
key comes from ``MEGATRON_AREAL_API_KEY`` (run/secrets.py); SIGUSR1 asks for a checkpoint and a stop. Only
servers that prove they hold the run's nonce are used (``util/run_identity.py``); a failure ends the rank at once,
whatever threads it started, and a heartbeat file tells the launcher it lives (``trainer/exit.py``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_areal.config import load_config
from megatron_areal.patches import upstream
from megatron_areal.run.control import checkpoint_on_usr1
from megatron_areal.run.plan import Plan
from megatron_areal.run.registry import wait_for_servers
from megatron_areal.run.secrets import apply_env_api_key
from megatron_areal.rundir.layout import RunDir, heartbeat_path
from megatron_areal.trainer import run_timeline
from megatron_areal.trainer.exit import run_rank, start_heartbeat
from megatron_areal.util.run_identity import run_nonce

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, wait for the plan's servers to register, run the trainer; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m megatron_areal.trainer")
    parser.add_argument("--plan", required=True, help="the plan the launcher wrote (RunDir.plan)")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    upstream.check()  # before anything runs on a megatron-core our patches do not fit
    cfg = apply_env_api_key(load_config(args.config, args.overrides))
    start_heartbeat(heartbeat_path(RunDir.of(cfg).resolved().root, rank))
    checkpoint_on_usr1(cfg.train.run_dir, f"trainer rank {rank}")  # any rank's USR1 asks for one
    if rank == "0":
        run_timeline.begin(Path(args.plan))
    plan = Plan.load(args.plan)
    registrations = RunDir.of(cfg).resolved().servers
    urls = wait_for_servers(registrations, list(plan.servers), cfg.server.startup_timeout_s, nonce=run_nonce())
    run_timeline.servers_ready(registrations, urls)
    from megatron_areal.trainer.loop import run_trainer  # heavy (Megatron); imported once the servers are up

    run_trainer(cfg, urls)
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(main))
