"""Launching a run: placement checks, the local launcher, the Slurm batch step and node roles.

``megatron-areal train`` (``launch/cli.py``) is the launcher; the processes it starts, on one
machine or through ``srun``, are trainer ranks (``python -m megatron_areal.trainer``), rollout
servers and, under Slurm, ``node_role``. Every process start of the package lives here:

- ``procs``: the children of one launcher, stopped together; ``ServerKeeper`` restarts dead servers;
- ``commands``: the command line and environment of each role;
- ``sglang``: the SGLang server's command line; ``server_process``: start one server, wait for its
  ``/health``, stop it; ``embedded``: the embedded server as a child (tests, benchmarks, and
  ``megatron-areal eval`` when given no ``--url``: ``megatron_areal/evaluation/cli.py``).

What the launcher shares with the processes it starts (the plan, registration, control files) lives in
``megatron_areal/run/``, the run directory's layout in ``megatron_areal/rundir/``; only the command line
(``megatron_areal/cli.py`` and the command modules it names) imports this package.
"""
