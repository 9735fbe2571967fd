"""The precision-aware optimizer (optimizer.precision_aware, actor/precision_adam.py) against torch's Adam.

- fp32 weights, gradients and moments: torch's ``AdamW`` and ``Adam`` bit for bit;
- bf16 weights with the master kept as remainders: the master follows torch's fp32 ``AdamW`` to within
  its last bit a step, and the weight is the master rounded to nearest;
- stochastic rounding: weights and bf16 moments equal torch's fp32 values in the mean, where
  nearest rounding would not move them, with bf16 or fp32 moments; its noise is uniform in every bit,
  however many elements a draw serves, and none is drawn where nothing is bf16;
- in Megatron's distributed optimizer: no fp32 state at all with bf16 gradients and moments (8 bytes a
  parameter where the default holds 16), a PPO step moves the weights as the default optimizer does,
  and a checkpoint resumes bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch
from test_actor_parallel import ARCHS, _trajectories

from megatron_areal.actor.precision_adam import PrecisionAwareAdam, _noise, join_master, split_master_
from megatron_areal.convert.spawn import WorkerPool
from megatron_areal.util.compute_dtype import BF16_ANYWAY_ENV

pytestmark = pytest.mark.timeout(300)


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], attr: str) -> None:
    for g in grads:
        for p in params:
            setattr(p, attr, g.to(p.dtype))
        opt.step()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fp32_equals_torch_adam_bit_for_bit(adam_w_mode):
    torch.manual_seed(0)
    start = torch.randn(5000) * 0.05
    grads = [torch.randn(5000) for _ in range(6)]
    ref, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    kwargs = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reference = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)([ref], fused=True, **kwargs)
    _steps(reference, [ref], grads, "grad")
    _steps(PrecisionAwareAdam([ours], adam_w_mode=adam_w_mode, **kwargs), [ours], grads, "decoupled_grad")
    assert torch.equal(ref, ours)


def test_bf16_master_follows_torch_adamw_and_weight_is_it_rounded_to_nearest():
    torch.manual_seed(1)
    weight = torch.nn.Parameter((torch.randn(20_000) * 0.05).bfloat16())
    master_ref = torch.nn.Parameter(weight.detach().float().clone())
    grads = [torch.randn(20_000).bfloat16().float() for _ in range(8)]
    _steps(torch.optim.AdamW([master_ref], lr=1e-4, weight_decay=0.01, foreach=False), [master_ref], grads, "grad")
    opt = PrecisionAwareAdam([weight], lr=1e-4, weight_decay=0.01)
    _steps(opt, [weight], grads, "decoupled_grad")
    master = join_master(weight.detach(), opt.state[weight]["master_param"])
    ref = master_ref.detach()
    # within one fp32 spacing a step, at the largest magnitude the weight passed through
    spacing = torch.finfo(torch.float32).eps * (master_ref.detach().abs().maximum(weight.detach().float().abs()) + 8e-4)
    assert float(((master - ref).abs() / spacing).max()) <= 8
    tie = master.view(torch.int32).bitwise_and(0xFFFF) == 0x8000  # halfway: ours rounds up in magnitude
    assert torch.equal(weight.detach()[~tie], master.bfloat16()[~tie])  # rounded to nearest
    assert float((weight.detach() != master_ref.detach().bfloat16()).float().mean()) < 1e-3


def test_split_and_join_keep_the_master_but_its_last_bit():
    torch.manual_seed(2)
    master = torch.randn(100_000) * torch.logspace(-6, 2, 100_000)
    for noise in (None, torch.randint(-1 << 15, 1 << 15, master.shape, dtype=torch.int16)):
        weight = torch.empty(master.shape, dtype=torch.bfloat16)
        remainder = torch.empty(master.shape, dtype=torch.int16)
        split_master_(master, weight, remainder, noise)
        back = join_master(weight, remainder)
        assert int((back.view(torch.int32) - master.view(torch.int32)).abs().max()) <= 1
        spacing = torch.ldexp(torch.ones_like(master), torch.frexp(master).exponent - 8)  # bf16's, at the master
        distance = (weight.float() - master).abs()
        assert bool((distance < spacing).all())  # one of the two bf16 neighbours
        if noise is None:
            assert bool((distance <= spacing / 2 * (1 + 2.0 ** -15)).all())  # and the nearest, to its last bit


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float32])
def test_stochastic_rounding_is_unbiased_where_nearest_is_stuck(moments):
    n = 400_000
    start = torch.full((n,), 0.05)
    grads = [torch.full((n,), 0.25 + 0.125 * i) for i in range(4)]  # exact in bf16
    ref = torch.nn.Parameter(start.bfloat16().float())
    reference = torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.0, foreach=False)
    _steps(reference, [ref], grads, "grad")
    out = {}
    for rounding in ("nearest", "stochastic"):
        w = torch.nn.Parameter(start.bfloat16())
        opt = PrecisionAwareAdam([w], lr=1e-5, rounding=rounding, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        _steps(opt, [w], grads, "decoupled_grad")
        out[rounding] = (w.detach().double(), opt.state[w])
    spacing = 2.0 ** -12  # bf16 at 0.05; four steps of 1e-5 are a sixth of it
    moved = float(ref.detach()[0]) - float(start.bfloat16()[0])
    assert abs(moved) > 0.1 * spacing
    assert bool((out["nearest"][0] == float(start.bfloat16()[0])).all())  # nearest never moved
    weights, state = out["stochastic"]
    assert abs(float(weights.mean()) - float(ref.detach()[0])) < 0.02 * spacing
    for key in ("exp_avg", "exp_avg_sq"):
        expected = float(reference.state[ref][key][0])
        assert state[key].dtype == moments
        assert abs(float(state[key].double().mean()) - expected) < 1e-3 * abs(expected)


@pytest.mark.parametrize("fields", [1, 2, 3])
def test_noise_is_uniform_in_every_bit_of_every_field(fields):
    n = 300_001  # not a multiple of the values a draw serves
    out = _noise(n, fields, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert [(f.shape, f.dtype) for f in out] == [((n,), torch.int16)] * fields
    for field in out:
        bits = field.to(torch.int32).bitwise_and(0xFFFF)
        ones = torch.stack([bits.bitwise_right_shift(b).bitwise_and(1) for b in range(16)]).double().mean(1)
        assert bool(((ones - 0.5).abs() < 0.005).all()), ones  # 5 standard errors at this n
        for quarter in bits.tensor_split(4):
            assert abs(float(quarter.double().mean()) / 0xFFFF - 0.5) < 0.005


def test_no_noise_is_drawn_where_nothing_is_rounded_to_bf16():
    w = torch.nn.Parameter(torch.randn(1000))
    opt = PrecisionAwareAdam([w], lr=1e-3, rounding="stochastic")  # fp32 weight and moments
    before = opt.generator.get_state()
    _steps(opt, [w], [torch.randn(1000)], "decoupled_grad")
    assert torch.equal(opt.generator.get_state(), before)


def test_state_keeps_its_dtypes_through_a_state_dict_and_the_master_through_a_checkpoint():
    w = torch.nn.Parameter((torch.randn(300) * 0.05).bfloat16())
    opt = PrecisionAwareAdam([w], lr=1e-4, exp_avg_dtype=torch.bfloat16, rounding="stochastic")
    w.decoupled_grad = torch.randn(300).bfloat16()
    opt.step()
    fresh = PrecisionAwareAdam([w], lr=1e-4, exp_avg_dtype=torch.bfloat16)
    fresh.load_state_dict(opt.state_dict())
    for key, value in opt.state[w].items():
        assert fresh.state[w][key].dtype == value.dtype and torch.equal(fresh.state[w][key], value), key
    # Megatron's checkpoints hold the fp32 master; loading it keeps the (stochastically rounded) weight
    master = opt.get_unscaled_state(w, "master_param")
    assert master.dtype == torch.float32 and not torch.equal(master.bfloat16(), w.detach())
    weight = w.detach().clone()
    other = PrecisionAwareAdam([w], lr=1e-4)
    other.set_scaled_state(w, "master_param", master)
    assert torch.equal(w.detach(), weight)
    assert torch.equal(other.state[w]["master_param"], opt.state[w]["master_param"])


# In Megatron's distributed optimizer (spawned, one rank)

def _weights(a) -> list[torch.Tensor]:
    return [p.detach().clone() for c in a.model for p in c.parameters()]


def _resumed_equal(ckpt, stepped, resumed) -> bool:
    """Load ``ckpt``'s latest checkpoint into ``resumed``, take one more step on both: equal weights?"""
    ckpt.load(ckpt.latest(), resumed.model, resumed.optimizer, resumed.scheduler)
    for a in (stepped, resumed):
        a.ppo_update(_trajectories(), 0.7)
    return all(torch.equal(x, y) for x, y in zip(_weights(stepped), _weights(resumed), strict=True))


def case_precision_aware(rounding: str, tmp: str) -> dict:
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.checkpoint.training import Checkpointer

    os.environ[BF16_ANYWAY_ENV] = "1"  # the bf16 path itself, also on CPUs without native bf16 matmuls
    groups = init_parallel(1, 1, seed=3, backend="gloo")

    def actor(precision_aware: bool, seed: int = 3):
        lean = dict(precision_aware=True, main_grads_dtype="bfloat16", exp_avg_dtype="bfloat16",
                    exp_avg_sq_dtype="bfloat16") if precision_aware else {}
        return Actor(ARCHS["llama"], ModelConfig(max_seq_len=40, dtype="bfloat16"),
                     ParallelConfig(tp=1, pp=1, max_tokens_per_mb=48),
                     OptimizerConfig(lr=1e-3, bf16_rounding=rounding, **lean), PPOConfig(), groups, seed=seed,
                     total_steps=4)

    def weights(a):
        return [p.detach().clone() for c in a.model for p in c.parameters()]

    out = {}
    default, lean = actor(False), actor(True)
    out["start_equal"] = all(torch.equal(x, y) for x, y in zip(weights(default), weights(lean), strict=True))
    start = weights(lean)
    for a in (default, lean):
        a.ppo_update(_trajectories(), 0.7)
    out["start"], out["default"], out["lean"] = start, weights(default), weights(lean)
    def subs(a):
        return getattr(a.optimizer, "chained_optimizers", [a.optimizer])

    out["no_fp32_master"] = all(m is None for o in subs(lean) for g in o.shard_fp32_from_float16_groups for m in g)
    n_params = sum(p.numel() for c in lean.model for p in c.parameters())

    def held_bytes(a) -> float:  # fp32 masters, moments, remainders
        masters = [m for o in subs(a) for g in o.shard_fp32_from_float16_groups for m in g if m is not None]
        state = [t for o in subs(a) for st in o.optimizer.state.values() for k, t in st.items() if k != "step"]
        return sum(t.numel() * t.element_size() for t in masters + state) / n_params

    out["state_bytes_per_param"] = {"default": held_bytes(default), "lean": held_bytes(lean)}
    out["grad_dtype"] = lean.model[0].buffers[0].grad_data.dtype
    ckpt = Checkpointer(tmp, ARCHS["llama"], groups, keep=1)
    ckpt.save(1, lean.model, lean.optimizer, lean.scheduler)

    def state_tensors(a) -> list[torch.Tensor]:
        return [t for o in subs(a) for st in o.optimizer.state.values() for k, t in st.items() if k != "step"]

    # at DP 1 a load reads the optimizer state into the optimizer's own tensors (the fp32 masters it holds
    # meanwhile, its moments), not into Megatron's whole-model fp32 tensors; here into a never-stepped one
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    other, requested, load = actor(True, seed=5), [], dist_checkpointing.load

    def storages(a) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in state_tensors(a)}

    def spy(request, *args, **kwargs):
        own = storages(other)
        requested.extend((sh.data.untyped_storage().data_ptr() in own, sh.data.untyped_storage().data_ptr(),
                          sh.data.dtype) for sh in nested_values(request["optimizer"]["param_state"]))
        return load(request, *args, **kwargs)

    dist_checkpointing.load = spy
    try:
        ckpt.load(ckpt.latest(), other.model, other.optimizer, other.scheduler)
    finally:
        dist_checkpointing.load = load
    out["loaded_into_own_tensors"] = bool(requested) and all(own for own, _, _ in requested)
    # and keeps them: the bf16 moments read are the moments held after (the masters go back to remainders)
    out["kept_them"] = all(ptr in storages(other) for _, ptr, dtype in requested if dtype == torch.bfloat16)
    out["loaded_state_equal"] = all(torch.equal(x, y) for x, y in
                                    zip(state_tensors(lean), state_tensors(other), strict=True))
    # the reference: Megatron's own load of the same checkpoint (its fp32 whole-model tensors, then copies)
    from contextlib import nullcontext

    from megatron_areal.checkpoint import training as checkpoint_module
    upstream, as_views = actor(True, seed=7), checkpoint_module.state_as_views
    checkpoint_module.state_as_views = lambda optimizer: nullcontext()
    try:
        ckpt.load(ckpt.latest(), upstream.model, upstream.optimizer, upstream.scheduler)
    finally:
        checkpoint_module.state_as_views = as_views
    out["equals_megatrons_load"] = all(torch.equal(x, y) for x, y in zip(
        state_tensors(upstream) + weights(upstream), state_tensors(other) + weights(other), strict=True))
    out["resumed_equal"] = _resumed_equal(ckpt, lean, actor(True, seed=9))
    teardown_parallel()
    return out


def test_in_megatrons_distributed_optimizer(tmp_path):
    with WorkerPool(1, timeout_s=300) as pool:
        out = pool.run(case_precision_aware, "nearest", str(tmp_path))[0]
    assert out["start_equal"]
    assert out["no_fp32_master"] and out["grad_dtype"] == torch.bfloat16
    # fp32 master 4 + moments 8 (the fp32 gradient buffer's 4 besides) against remainders 2 + bf16 moments 4
    assert out["state_bytes_per_param"] == {"default": 12.0, "lean": 6.0}
    # one PPO step at lr 1e-3 moves the weights by about lr either way, in the same direction
    for start, default, lean in zip(out["start"], out["default"], out["lean"], strict=True):
        d, ln = (default.float() - start.float()).flatten(), (lean.float() - start.float()).flatten()
        if not d.any():  # a weight the batch does not reach
            assert not ln.any()
            continue
        assert float(torch.nn.functional.cosine_similarity(d, ln, dim=0)) > 0.99
    assert out["loaded_into_own_tensors"] and out["kept_them"] and out["loaded_state_equal"]
    assert out["equals_megatrons_load"]
    assert out["resumed_equal"]


def case_fp32_weights(tmp: str) -> dict:
    """The main job's optimizer settings where the weights are fp32 (model.dtype float32, or bfloat16 on a
    CPU without native bf16, util/compute_dtype.py): a step, a checkpoint, a resumed run."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.checkpoint.training import Checkpointer

    groups = init_parallel(1, 1, seed=3, backend="gloo")

    def actor(seed: int = 3):
        return Actor(ARCHS["llama"], ModelConfig(max_seq_len=40, dtype="float32"),
                     ParallelConfig(tp=1, pp=1, max_tokens_per_mb=48),
                     OptimizerConfig(lr=1e-3, precision_aware=True, bf16_rounding="stochastic",
                                     main_grads_dtype="bfloat16", exp_avg_dtype="bfloat16",
                                     exp_avg_sq_dtype="bfloat16"),
                     PPOConfig(), groups, seed=seed, total_steps=4)

    out = {}
    first = actor()
    start = _weights(first)
    first.ppo_update(_trajectories(), 0.7)
    out["moved"] = any(not torch.equal(x, y) for x, y in zip(start, _weights(first), strict=True))
    out["dtype"] = start[0].dtype
    ckpt = Checkpointer(tmp, ARCHS["llama"], groups, keep=1)
    ckpt.save(1, first.model, first.optimizer, first.scheduler)
    out["resumed_equal"] = _resumed_equal(ckpt, first, actor(seed=9))
    teardown_parallel()
    return out


def test_fp32_weights_step_save_and_resume(tmp_path):
    """Until fixed, the main job on an AVX2-only CPU (fp32 weights under these settings) trained, then died
    at its first checkpoint: Megatron looked for a ``master_param`` that fp32 weights did not have."""
    with WorkerPool(1, timeout_s=300) as pool:
        out = pool.run(case_fp32_weights, str(tmp_path))[0]
    assert out["dtype"] == torch.float32 and out["moved"]
    assert out["resumed_equal"]


def case_data_parallel(root: str, save: bool) -> dict:
    """One precision-aware step on the same batch at this world size (all ranks data parallel). With ``save``
    the checkpoint goes to ``root`` and is loaded back at this layout; else the checkpoint there (saved at
    DP2) is loaded into a one-rank actor."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.checkpoint.training import Checkpointer

    os.environ[BF16_ANYWAY_ENV] = "1"  # the bf16 path itself, also on CPUs without native bf16 matmuls
    groups = init_parallel(1, 1, seed=3, backend="gloo")

    def actor(seed: int = 3):
        return Actor(ARCHS["llama"], ModelConfig(max_seq_len=40, dtype="bfloat16"),
                     ParallelConfig(tp=1, pp=1, max_tokens_per_mb=48),
                     OptimizerConfig(lr=1e-3, precision_aware=True, main_grads_dtype="bfloat16",
                                     exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16"),
                     PPOConfig(), groups, seed=seed, total_steps=4)

    def weights(a) -> list[torch.Tensor]:
        return [p.detach().clone() for c in a.model for p in c.parameters()]

    def state(a) -> list[torch.Tensor]:  # this rank's masters (fp32) and moments, parameter by parameter
        out = []
        for c in a.model:
            for p in c.parameters():
                for sub in getattr(a.optimizer, "chained_optimizers", [a.optimizer]):
                    if p in sub.model_param_group_index_map:  # at DP > 1: a shard on this rank
                        out += [t.detach().clone().view(-1)
                                for t in sub._get_main_param_and_optimizer_states(p).values() if t.dim()]
        return out

    ckpt = Checkpointer(root, ARCHS["llama"], groups, keep=1)
    out = {}
    if save:
        stepped = actor()
        stepped.ppo_update(_trajectories(), 0.7)
        out["weights"] = weights(stepped)
        ckpt.save(1, stepped.model, stepped.optimizer, stepped.scheduler)
        loaded = actor(seed=9)
        ckpt.load(ckpt.latest(), loaded.model, loaded.optimizer, loaded.scheduler)
        out["state_equal"] = all(torch.equal(x, y) for x, y in zip(state(stepped), state(loaded), strict=True))
    else:
        stepped = actor()
        stepped.ppo_update(_trajectories(), 0.7)
        out["stepped"] = weights(stepped)
        loaded = actor(seed=9)
        ckpt.load(ckpt.latest(), loaded.model, loaded.optimizer, loaded.scheduler)
        out["weights"] = weights(loaded)
        masters = [t for t in state(loaded) if t.dtype == torch.float32]
        out["weights_are_masters_rounded"] = all(  # to nearest; halfway ties round up in magnitude, not to even
            torch.equal(w.view(-1)[keep], m.bfloat16()[keep]) for w, m in zip(out["weights"], masters, strict=True)
            for keep in [m.view(torch.int32).bitwise_and(0xFFFF) != 0x8000])
    teardown_parallel()
    return out


def test_data_parallel_step_and_checkpoint(tmp_path):
    """Two data-parallel ranks take the step one rank takes on the same batch (to bf16 rounding: their
    gradients sum in another order); their checkpoint loads back at DP2 with the same masters and
    moments, and at one rank with the same weights and masters they round to."""
    with WorkerPool(2, timeout_s=300) as pool:
        two = pool.run(case_data_parallel, str(tmp_path), True)
    with WorkerPool(1, timeout_s=300) as pool:
        one = pool.run(case_data_parallel, str(tmp_path), False)[0]
    assert two[0]["state_equal"] and two[1]["state_equal"]
    assert all(torch.equal(a, b) for a, b in zip(two[0]["weights"], two[1]["weights"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(two[0]["weights"], one["weights"], strict=True))
    assert one["weights_are_masters_rounded"]
    for a, b in zip(two[0]["weights"], one["stepped"], strict=True):
        # Adam's step is +-lr where a gradient is near zero, whichever side the other order puts it
        assert float((a.float() - b.float()).abs().max()) <= 2e-3 + float(a.float().abs().max()) / 128
        assert float((a != b).float().mean()) < 0.05
