"""The weight path: the trainer's Megatron shards -> HF layout -> the rollout servers.

``push.WeightSync`` is the trainer's entry point (``config.WeightsConfig`` its settings, the
``weights:`` section). Two ways for the bytes:

- the shard push (the embedded server, vLLM through ``vllm_plugin/``): ``plan`` says which trainer
  rank sends which HF slice to which server rank, ``streams`` cuts that into rounds and manifests,
  ``shard_send`` packs and sends one rank's buckets overlapped, ``shard_push`` runs it over one group;
- the stage heads (SGLang): ``gather`` and ``buckets`` turn a stage's shards into HF-named buckets on its
  head, ``link`` broadcasts them over the stage's group.

``endpoints`` holds the servers' weight-update routes per protocol, ``disk`` the path through a shared
folder. ``wire`` is the part both ends share (how the group is formed, how slices are received); the
servers import that module and nothing else of this package, so this ``__init__`` imports nothing (a
server must not pull in Megatron).
"""
