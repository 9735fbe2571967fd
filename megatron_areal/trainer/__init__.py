"""One trainer rank: ``python -m megatron_areal.trainer --plan PLAN CONFIG [key=value ...]``.

``__main__`` waits for the servers and starts ``loop.run_trainer``; ``policy`` is the model every
rank trains and pushes, ``rank0`` the duties only rank 0 has (rollouts, rewards, eval, metrics).
"""
