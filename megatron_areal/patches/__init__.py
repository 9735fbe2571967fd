"""Every change this package makes to third-party behaviour, one module each, and their index.

- ``version``: ``MEGATRON_CORE_VERSION``, the megatron-core release they are written against (setup.py reads it);
- ``upstream``: the index (``CHANGES``) and ``check``, which the trainer runs before it starts;
- the changes: ``cpu_gloo`` (megatron-core on CPU/gloo, with its local-spec norm ``rms_norm``),
  ``moe_router`` (the MoE router without Transformer Engine), ``packed_rope`` (one rotary table per
  micro-batch), ``bf16_rounding`` (stochastic rounding of the bf16 weights), ``precision_aware_without_te``
  (the precision-aware optimizer around our Adam), ``checkpoint_writer`` (the checkpoint writer without
  clones), ``optimizer_state_views`` (optimizer state as views at data-parallel size 1).

Each change names the upstream distribution and version, why it exists, the module that applies it, and the
facts about the pinned upstream's source it relies on. ``check`` reads the installed upstream's files and
names every fact that no longer holds, so an upgrade that moves a patched site fails loudly instead of running
unpatched code. The human-readable index is ``patches/README.md`` at the repository's root. This package
imports nothing of ``megatron_areal`` outside it.
"""
