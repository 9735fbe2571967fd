"""Launching a run: placement checks, the local launcher, the Slurm batch step and node roles.

``megatron-areal train`` (``launch/cli.py``) is the launcher; the processes it starts, on one
machine or through ``srun``, are trainer ranks (``python -m megatron_areal.trainer``), rollout
servers and, under Slurm, ``node_role``. Every process start of the package lives here:

- ``procs``: the children of one launcher, stopped together; ``ServerKeeper`` restarts dead servers;
- ``commands``: the command line and environment of each role;
- ``sglang``: the SGLang server's command line; ``server_process``: start one server, wait for its
  ``/health``, stop it; ``embedded``: the embedded server as a child (tests, benchmarks, eval);
- ``eval_cli``: ``megatron-areal eval``, which starts an embedded server when given no ``--url``.

What the launcher shares with the processes it starts (the plan, registration, control files, the run
directory) lives in ``megatron_areal/run/``; only the command line (``megatron_areal/cli.py``) imports
this package.
"""
