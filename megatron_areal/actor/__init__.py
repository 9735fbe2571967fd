"""The Megatron-core policy: model building, packed forward, vocab-parallel logprobs, PPO updates.

``parallel`` sets up the TP/PP/DP groups (and, on gloo, the CPU redirect of ``megatron_areal/patches/cpu_gloo.py``);
``model`` builds GPTModel chunks; ``microbatch`` packs sequences; ``logprobs`` computes
vocab-parallel logprobs; ``engine`` runs Megatron's pipeline schedule; ``actor`` ties them into
``Actor.compute_logprobs`` and ``Actor.ppo_update``.
"""
