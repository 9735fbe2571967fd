"""Prompt and response lengths: long-tailed (log-normal) and truncated at the generation limit.

Reasoning models' response lengths are right-skewed with a tail that reaches the limit: a log-normal
with mean ``m`` and log-space deviation ``sigma`` has ``mu = ln(m) - sigma^2 / 2``. A draw above
``max_new_tokens`` is truncated to it, which is what a server does (``finish_reason: length``).
"""
from __future__ import annotations

import math
import random


class LengthSampler:
    def __init__(self, prompt_mean: float, response_mean: float, sigma: float, max_new_tokens: int,
                 seed: int) -> None:
        self._rng = random.Random(seed)
        self.max_new_tokens = max_new_tokens
        self._mu = math.log(response_mean) - sigma * sigma / 2
        self._sigma = sigma
        self._prompt_mean = prompt_mean

    def prompt(self) -> int:
        # Prompts vary far less than responses; +-50% uniform around the mean.
        return max(1, round(self._prompt_mean * self._rng.uniform(0.5, 1.5)))

    def response(self) -> int:
        return max(1, min(self.max_new_tokens, round(self._rng.lognormvariate(self._mu, self._sigma))))

    def truncated_fraction(self) -> float:
        """Probability that a response hits the limit (analytic, for reports)."""
        z = (math.log(self.max_new_tokens) - self._mu) / self._sigma
        return 0.5 * math.erfc(z / math.sqrt(2))
