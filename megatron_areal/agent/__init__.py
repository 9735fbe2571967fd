"""Multi-turn and agentic rollouts: a user's agent drives several completions through an
OpenAI-compatible endpoint the rollout controller serves, and the episode becomes training data.

- ``render``: messages -> prompt token ids with the model's chat template; later turns reuse the
  recorded tokens of earlier ones.
- ``tool_calls``: tool calls parsed from a reply in the template's format.
- ``session`` / ``endpoint``: one episode's record of turns, and the HTTP endpoint serving them.
- ``workflow``: the user's ``run_episode`` loaded from ``rollout.workflow`` and run with bounds.
- ``to_trajectories``: an episode -> trajectories with a per-position loss mask.
- ``runner``: episodes of a group on the rollout loop; ``from_config``: built from the run's ``rollout``
  section. Held-out success of greedy episodes is ``megatron_areal/evaluation/agent.py``.
- ``calculator`` / ``calculator_task``: a safe arithmetic tool and the built-in task that needs it.
- ``code_tool``: the ``python`` tool, which runs a program in the reward's code sandbox.

``docs/agents.md`` shows how to write an agent.
"""
