"""Held-out evaluation: how well a policy answers prompts it is not trained on.

- ``held_out``: accuracy of greedy single completions on the fleet's servers (the trainer's rank 0 and
  ``megatron-areal eval`` both call it);
- ``agent``: success and tool use of an agent's greedy episodes (runs with ``rollout.workflow``);
- ``cli``: ``megatron-areal eval``, which starts an embedded server when given no ``--url``.
"""
