import pytest
import torch

from megatron_areal.algorithm import (
    decoupled_ppo_loss,
    group_advantages,
    kl_penalty,
    normalize_advantages,
    staleness_capacity,
)


def _inputs(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.3
    return logp, prox, behav, adv, mask


def _plain_ppo(logp, old, adv, mask, eps):
    ratio = torch.exp(logp - old)
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return -(obj * mask).sum() / mask.sum()


def test_equals_plain_ppo_when_proximal_is_behaviour():
    logp, prox, _, adv, mask = _inputs()
    loss, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    assert torch.allclose(loss, _plain_ppo(logp, prox, adv, mask, 0.2), atol=1e-12)
    assert stats["importance_weight_mean"] == pytest.approx(1.0)
    assert stats["tokens"] == float(mask.sum())


def test_behaviour_weight_scales_objective_without_gradient():
    logp, prox, behav, adv, mask = _inputs(seed=1)
    logp = logp.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    w = torch.exp(prox - behav)
    ratio = torch.exp(logp - prox)
    expected = -(w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected)
    loss.backward()
    assert prox.grad is None and behav.grad is None


def test_capped_tokens_are_dropped_but_still_counted():
    logp, prox, behav, adv, mask = _inputs(seed=2)
    behav = behav.clone()
    behav[0] = prox[0] - 5.0  # w = e^5 > cap
    mask[0] = True
    cap = 3.0
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=cap)
    w = torch.exp(prox - behav)
    keep = mask & (w <= cap)
    ratio = torch.exp(logp - prox)
    obj = w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert torch.allclose(loss, -(obj * keep).sum() / mask.sum())
    assert stats["dropped_tokens"] == float((mask & ~keep).sum()) >= 1


def test_gradient_matches_finite_differences():
    logp, prox, behav, adv, mask = _inputs(n=12, seed=3)
    logp = logp.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    (grad,) = torch.autograd.grad(loss, logp)
    h = 1e-6
    for i in range(logp.numel()):
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i] += h
        minus[i] -= h
        fd = (decoupled_ppo_loss(plus, prox, behav, adv, mask, 0.2, 0.28)[0]
              - decoupled_ppo_loss(minus, prox, behav, adv, mask, 0.2, 0.28)[0]) / (2 * h)
        assert abs(float(fd) - float(grad[i])) < 1e-6


def test_asymmetric_clip_uses_high_bound():
    adv = torch.ones(1, dtype=torch.float64)
    prox = torch.zeros(1, dtype=torch.float64)
    logp = torch.log(torch.tensor([1.25], dtype=torch.float64))  # ratio 1.25
    mask = torch.ones(1, dtype=torch.bool)
    low, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    high, stats = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.3)
    assert float(low) == pytest.approx(-1.2) and float(high) == pytest.approx(-1.25)
    assert stats["clip_fraction"] == 0.0


def test_micro_batch_losses_add_up_to_full_batch():
    logp, prox, behav, adv, mask = _inputs(seed=4)
    full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    n = float(mask.sum())
    parts = sum(decoupled_ppo_loss(logp[s], prox[s], behav[s], adv[s], mask[s], loss_scale_tokens=n)[0]
                for s in (slice(0, 20), slice(20, 64)))
    assert torch.allclose(full, parts)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same shape|share one shape"):
        decoupled_ppo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(4), torch.ones(3))


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = group_advantages(r, "grpo")
    assert torch.allclose(grpo[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.all(grpo[1] == 0)
    assert torch.allclose(group_advantages(r, "drgrpo")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    rloo = group_advantages(r, "rloo")[0]
    assert torch.allclose(rloo, torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    with pytest.raises(ValueError, match="unknown advantage kind"):
        group_advantages(r, "ppo")


def test_normalize_and_kl():
    adv = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    out = normalize_advantages(adv, mask, count=3, total=6.0, total_sq=14.0)
    assert torch.allclose(out[:3].mean(), torch.tensor(0.0), atol=1e-6) and out[3] == 0
    kl = kl_penalty(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5]))
    assert kl[0] == 0 and kl[1] > 0


@pytest.mark.parametrize("eta,version,accepted,running,expected", [
    (4, 3, 200, 50, 206),   # bounded by concurrency
    (0, 0, 0, 0, 64),       # synchronous: one batch
    (0, 0, 60, 4, 0),       # a full batch exists
    (1, 2, 250, 0, 6),      # (1 + 2 + 1) * 64 - 250
    (0, 5, 1000, 0, 0),     # never negative
])
def test_staleness_capacity(eta, version, accepted, running, expected):
    assert staleness_capacity(eta=eta, version=version, batch_size=64, accepted=accepted, running=running,
                              max_concurrent=256) == expected


def test_staleness_capacity_rejects_impossible_counts():
    with pytest.raises(ValueError, match="running"):
        staleness_capacity(eta=1, version=0, batch_size=4, accepted=0, running=-1, max_concurrent=8)


def test_single_minibatch_proximal_is_the_detached_training_logprobs():
    # With one optimizer step per batch the actor uses logp.detach() as pi_prox instead of a second
    # forward; loss and gradient must equal those with an explicitly recomputed proximal tensor.
    logp, _, behav, adv, mask = _inputs(seed=5)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    loss_a, stats_a = decoupled_ppo_loss(a, a.detach(), behav, adv, mask, behav_imp_weight_cap=5.0)
    loss_b, stats_b = decoupled_ppo_loss(b, logp.clone(), behav, adv, mask, behav_imp_weight_cap=5.0)
    (ga,) = torch.autograd.grad(loss_a, a)
    (gb,) = torch.autograd.grad(loss_b, b)
    assert torch.equal(loss_a, loss_b) and torch.equal(ga, gb) and stats_a == stats_b
