"""Parameter reallocation: the trainer's Megatron shards -> HF layout -> the rollout servers.

``sync.WeightSync`` is the entry point; ``group.WeightUpdateGroup`` is also imported by the
servers, so this package imports nothing on its own (a server must not pull in Megatron).
"""
