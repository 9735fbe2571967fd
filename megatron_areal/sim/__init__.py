"""Discrete-event model of a whole RL run on a GPU cluster, synchronous and asynchronous.

Modules by concern: ``costs`` (decode step, prefill, training step, weight update from first
principles), ``workload`` (long-tailed response lengths), ``server`` (continuous batching over a
KV cache, interruptible updates), ``engine`` (events, the real ``StalenessGate``, the trainer),
``scenario`` (one setting read from the run's config tree), ``result``/``report`` (figures),
``planner`` (split x eta sweep, 16-512 GPU scaling), ``plots``, ``calibrate`` and ``cli``.

The efficiencies in ``SimConfig`` (HBM, MFU, per-step overhead) are stated defaults, not values
fitted to the paper; ``megatron-areal simulate --calibrate RUN_DIR`` refits them to a real run.

The simulator's settings (``SimConfig``, the ``sim:`` section) and the published GPU peaks live in
``megatron_areal/cluster/``, below the config tree, because the simulator reads the whole tree.
"""
