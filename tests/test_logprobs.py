"""Per-token logprobs and entropy from (a rank's slice of) the logits, against torch's own log_softmax."""
from __future__ import annotations

import pytest
import torch

from megatron_areal.actor import logprobs as lp_module
from megatron_areal.actor.logprobs import vocab_parallel_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, real: int, temperature: float):
    """torch.log_softmax over the real vocabulary, in fp32, and the entropy of that distribution."""
    z = logits[:, :real].float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("width,real", [(1000, 1000), (1024, 990)])  # 990: TP padding columns at the end
def test_logprobs_entropy_and_gradient_match_torch(dtype, temperature, width, real):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(300, width, generator=g)).to(dtype)
    targets = torch.randint(0, real, (300,), generator=g)
    weights = torch.randn(300, generator=g)
    ours = logits.clone().requires_grad_()
    got_lp, got_ent = vocab_parallel_logprobs(ours, targets, tp_group=None, tp_rank=0, vocab_size=real,
                                              temperature=temperature)
    (got_lp * weights).sum().backward()
    ref = logits.clone().requires_grad_()
    want_lp, want_ent = _reference(ref, targets, real, temperature)
    (want_lp * weights).sum().backward()
    assert torch.allclose(got_lp, want_lp, atol=1e-5, rtol=0) and torch.allclose(got_ent, want_ent, atol=1e-4, rtol=0)
    assert ours.grad.dtype == dtype and bool((ours.grad[:, real:] == 0).all())
    # fp32: a few ulps (AVX2 and AVX-512 kernels sum in different orders: 1.7e-6 on gradients up to 4)
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 0)
    assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_of_rows_give_the_one_piece_results_and_leave_the_logits_alone(dtype, monkeypatch):
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(257, 640, generator=g)).to(dtype)
    targets = torch.randint(0, 600, (257,), generator=g)
    results = []
    for elements in (1 << 30, 640 * 10):  # one block; blocks of 10 rows (the last one of 7)
        monkeypatch.setattr(lp_module, "_CHUNK_ELEMENTS", elements)
        x = logits.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, targets, tp_group=None, tp_rank=0, vocab_size=600)
        lp.sum().backward()
        assert torch.equal(x.detach(), logits)  # worked on copies: the caller's logits are unchanged
        results.append((lp, ent, x.grad))
    for one, blocked in zip(*results, strict=True):
        assert torch.equal(one, blocked)
