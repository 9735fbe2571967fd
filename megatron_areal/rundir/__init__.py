"""The run directory (``train.run_dir``) and what a run records in it for its user.

- ``layout``: ``RunDir``, the one map of every file a run writes;
- ``metrics``: per-step scalars (``metrics.jsonl``, TensorBoard), held-out accuracy, the progress bar;
- ``ledger``: which prompts each step trained (``trained.jsonl``);
- ``timeline``: every role's activity over the run (``timeline.json``, ``timeline_summary.json``).

It imports nothing of the package but the shared records (``megatron_areal/records.py``), so every part
that writes to the run directory (the rollout loop, the reward pool, the trainer) may depend on it.
"""
