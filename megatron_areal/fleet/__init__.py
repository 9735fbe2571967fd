"""The rollout servers as the trainer reaches them: one HTTP client per server and the ``Fleet`` that holds them.

Rollouts (``rollout/``), held-out evaluation and the weight push (``weights/``) all use the same
``Fleet``; trainer rank 0 opens it once (``trainer/loop.py``). ``client.RolloutClient`` speaks SGLang's
protocol (SGLang and the embedded server), ``vllm_client.VLLMClient`` vLLM's; ``backends`` picks one
per ``server.engine``; ``routing`` holds the members' health and load. The weight-update routes are
not here: they are the weight path's (``weights/endpoints.py``).
"""
