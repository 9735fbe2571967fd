"""Launching a run: placement (plan, checks), the local launcher, the Slurm batch step and node roles.

``megatron-areal train`` (``megatron_areal/train.py``) is the entry; ``trainer_main`` and
``node_role`` are the processes it starts, on one machine or through ``srun``.
"""
