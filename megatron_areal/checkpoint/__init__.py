"""Training checkpoints (``training.py``), their settings (``config.py``) and the on-disk model format they share
with ``megatron-areal convert`` (``dist_ckpt.py``)."""
