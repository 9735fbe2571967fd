"""Token sampling for a batch of rows, each with its own parameters and random stream.

The returned logprob is SGLang's default: ``log_softmax(logits / T)`` at the chosen token, with
temperature applied and top-p/top-k truncation not; greedy rows (temperature below
``GREEDY_BELOW``, as in SGLang) use T = 1. Each request draws from its own seeded generator, so its
tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# SGLang runs temperatures below this as greedy (T = 1, top_k = 1): dividing logits by 1e-300
# overflows to inf and the log-softmax to NaN.
GREEDY_BELOW = 1e-6


@dataclass
class SamplingParams:
    """SGLang's sampling parameters of one request, as the embedded engine supports them."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded output
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None  # SGLang's sampling_seed

    @property
    def greedy(self) -> bool:
        """Temperature 0 (below ``GREEDY_BELOW``) or top-k 1: the argmax token."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B], logprobs [B])."""
    # temperature 0 is greedy and scored at T=1; top_k=1 is greedy too but keeps its temperature.
    temps = [1.0 if p.temperature < GREEDY_BELOW else p.temperature for p in params]
    scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=logits.device)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    greedy = [p.greedy for p in params]
    # Each full-vocabulary pass is a few milliseconds at a decode step's 32 rows: only the ones needed.
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_rows(logprobs, params, generators)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def _sample_rows(logprobs: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform per row from that row's generator.

    ``right=True`` picks the first index whose CDF exceeds the draw, never a zero-mass token.
    Rows without truncation always take the plain CDF, so a seeded request draws the same token
    whether or not a top-k/top-p request shares its batch.
    """
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(logprobs.device)
    probs = logprobs.exp()
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    truncated = [not p.greedy and (p.top_p < 1.0 or 0 < p.top_k < vocab) for p in params]
    if any(truncated):
        rows = torch.tensor(truncated, device=probs.device)
        tokens = torch.where(rows, _sample_truncated(probs, u, params), tokens)
    return tokens


def _sample_truncated(probs: torch.Tensor, u: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Draw ``u`` from each row's top-k, top-p support (most probable tokens first)."""
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Any top_k past the vocabulary means all of it (SGLang's own default is 2^30); clamping here
    # also keeps the values inside int64.
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each candidate
    keep = (ranks < top_k[:, None]) & (before < top_p[:, None])
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    return order.gather(1, idx).squeeze(1)
