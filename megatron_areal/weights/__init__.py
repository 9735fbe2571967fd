"""The weight path: the trainer's Megatron shards -> HF layout -> the rollout servers.

``push.WeightSync`` is the trainer's entry point (``config.WeightsConfig`` its settings, the
``weights:`` section); ``gather`` and ``buckets`` turn a stage's shards into HF-named buckets,
``link`` streams them over a stage's group with the servers, ``endpoints`` holds the servers'
weight-update routes per protocol, ``disk`` is the path through a shared folder. ``wire`` is the
part both ends share (how the weight-update group is formed); the servers import that module
and nothing else of this package, so this ``__init__`` imports nothing (a server must not pull
in Megatron).
"""
