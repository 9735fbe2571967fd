"""Stochastic rounding of fp32 master weights into bf16 model weights (optimizer.bf16_rounding)."""
from __future__ import annotations

import torch

from megatron_areal.util.rounding import stochastic_round_


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 value (torch's own conversions)."""
    down = x.to(torch.bfloat16)
    down = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-float("inf"), dtype=torch.bfloat16)), down)
    return down, torch.nextafter(down, torch.tensor(float("inf"), dtype=torch.bfloat16))


def test_rounds_to_a_neighbour_with_the_remainder_as_probability():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-4, 1, 4096)
    down, up = neighbours(x)
    out = torch.empty(4096, dtype=torch.bfloat16)
    ups = torch.zeros(4096)
    for _ in range(400):
        stochastic_round_(out, x, g)
        assert bool(((out == down) | (out == up)).all())
        ups += (out != down).float()
    p_up = ((x - down.float()) / (up.float() - down.float())).abs()
    exact = down.float() == x
    assert bool((ups[exact] == 0).all())
    # 400 draws: the binomial standard error is at most 0.025
    assert float((ups / 400 - p_up).abs().max()) < 0.13
    assert abs(float((ups / 400 - p_up).mean())) < 0.005


def test_rounding_in_chunks_draws_the_same_as_in_one_piece():
    x = torch.randn(10_007) * 0.05
    whole, pieces = torch.empty(10_007, dtype=torch.bfloat16), torch.empty(10_007, dtype=torch.bfloat16)
    stochastic_round_(whole, x, torch.Generator().manual_seed(5), chunk=1 << 20)
    stochastic_round_(pieces, x, torch.Generator().manual_seed(5), chunk=1000)
    assert torch.equal(whole.view(torch.int16), pieces.view(torch.int16))
    assert not torch.equal(whole, x.to(torch.bfloat16))  # not simply nearest rounding


def test_mean_of_many_roundings_is_the_value_where_nearest_rounding_is_stuck():
    g = torch.Generator().manual_seed(1)
    ulp = 2.0 ** -7  # bf16's spacing on [1, 2)
    x = torch.full((200_000,), 1.0 + 0.1 * ulp)  # a master weight 0.1 spacing above 1
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x, g)
    assert x.to(torch.bfloat16).float().unique().tolist() == [1.0]  # nearest never moves
    assert abs(float(out.float().mean()) - float(x[0])) < 0.01 * ulp


def _drift(rounding: str) -> dict[str, float]:
    """A bf16 model and Megatron's distributed optimizer: five Adam steps at lr 1e-5 with a constant
    gradient; how far the bf16 weights moved against the fp32 master."""
    from megatron_areal.actor.config import OptimizerConfig
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.optim import build_train_state
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.arch import ModelArch

    arch = ModelArch(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling=None, qkv_bias=False, qk_norm=False, tie_word_embeddings=False)
    groups = init_parallel(1, 1, seed=1, backend="gloo")
    chunks = build_model(arch, groups, dtype=torch.bfloat16, seed=1)
    with torch.no_grad():  # weights of SmolLM2's typical size, where bf16's spacing is 2.4e-4
        for p in (p for c in chunks for p in c.parameters()):
            p.uniform_(0.035, 0.06, generator=torch.Generator().manual_seed(p.numel()))
    state = build_train_state(chunks,
                              OptimizerConfig(lr=1e-5, clip_grad=0.0, bf16_rounding=rounding), groups, total_steps=5)
    params = [p for c in state.model for p in c.parameters() if p.dim() > 1]
    before = [p.detach().float().clone() for p in params]
    for _ in range(5):
        for p in params:
            p.main_grad.fill_(1.0)  # Adam: each step moves every weight by -lr
        state.optimizer.step()
    moved = torch.cat([(b - p.detach().float()).flatten() for p, b in zip(params, before)])
    teardown_parallel()
    return {"mean_moved": float(moved.mean()), "changed": float((moved != 0).float().mean())}


def test_stochastic_rounding_carries_small_steps_into_the_bf16_model():
    from megatron_areal.convert.spawn import WorkerPool

    with WorkerPool(1, timeout_s=600) as pool:
        nearest = pool.run(_drift, "nearest")[0]
        stochastic = pool.run(_drift, "stochastic")[0]
    # the master moved 5e-5 per weight, under half of bf16's spacing: nearest rounding leaves every
    # bf16 weight where it was, stochastic rounding moves them by the master's step on average
    assert nearest == {"mean_moved": 0.0, "changed": 0.0}, nearest
    assert abs(stochastic["mean_moved"] - 5e-5) < 0.1 * 5e-5, stochastic
    assert stochastic["changed"] > 0.1, stochastic
