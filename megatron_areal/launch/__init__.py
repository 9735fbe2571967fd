"""Launching a run: placement (plan, checks), the local launcher, the Slurm batch step and node roles.

``megatron-areal train`` (``launch/cli.py``) is the launcher; the processes it starts, on one
machine or through ``srun``, are trainer ranks (``python -m megatron_areal.trainer``), rollout
servers and, under Slurm, ``node_role``.
"""
