"""Off-policy corrections and mismatch metrics (megatron_areal/algorithm/offpolicy.py).

Three kinds of reference:

- hand-computed small examples for every correction (MIS, TIS, icepop-style two-sided mask,
  sequence-level geometric-mean mask) and for the mismatch metrics;
- AReaL 1.0.4's own ``ppo_actor_loss_fn`` / ``apply_rejection_sampling`` from its wheel
  (``pip install --no-deps areal==1.0.4``, in scripts/install_test_refs.sh). Importing ``areal``
  runs its package ``__init__`` (httpx, uvloop, hydra, ...), so ``_areal()`` compiles just the
  named top-level definitions from the wheel's source files, the way tests/sglang_ref.py does for
  SGLang; the code that runs is the wheel's, byte for byte;
- the real actor on gloo against the embedded server's sampling logprobs for the same tiny model,
  for the fp32 CPU mismatch figures.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import math
import sys
import types
import typing
from pathlib import Path

import pytest
import torch

from megatron_areal.algorithm import PPOObjective, decoupled_ppo_loss
from megatron_areal.algorithm.config import PPOConfig
from megatron_areal.algorithm.offpolicy import quantile, rollout_mismatch_metrics
from megatron_areal.configbase import ConfigError

AREAL_VERSION = "1.0.4"
INSTALL_HINT = "install the test references: bash scripts/install_test_refs.sh"

# ---------------------------------------------------------------- hand-computed examples
# Four loss tokens, proximal == current (u = 1, inside the clip range, so the surrogate is A),
# behaviour weights w = 0.25, 0.8, 2, 8; two sequences: tokens {0, 1} and {2, 3}.
W = torch.tensor([0.25, 0.8, 2.0, 8.0], dtype=torch.float64)
A = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=torch.float64)
SEQ = torch.tensor([0, 0, 1, 1])


def _hand(seq_ids=None, **kw):
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    behav = logp.detach() - W.log()
    loss, stats = PPOObjective(**kw)(logp, logp.detach(), behav, A, torch.ones(4, dtype=torch.bool), seq_ids=seq_ids)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, stats


@pytest.mark.parametrize("kw, objective, weights, dropped, truncated, seqs", [
    # no correction: 0.25*1 + 0.8*(-1) + 2*2 + 8*1 = 11.45
    ({}, 11.45, [0.25, 0.8, 2, 8], 0, 0, 0),
    # MIS, C = 5: the w = 8 token is dropped: 0.25 - 0.8 + 4 = 3.45
    ({"behav_imp_weight_cap": 5.0}, 3.45, [0.25, 0.8, 2, 0], 1, 0, 0),
    # TIS, C = 5: the w = 8 token is kept at weight 5: 0.25 - 0.8 + 4 + 5 = 8.45
    ({"behav_imp_weight_cap": 5.0, "behav_imp_weight_mode": "truncate"}, 8.45, [0.25, 0.8, 2, 5], 0, 1, 0),
    # icepop-style [0.5, 5]: w = 0.25 and w = 8 dropped: -0.8 + 4 = 3.2
    ({"behav_imp_weight_cap": 5.0, "behav_imp_weight_low": 0.5}, 3.2, [0, 0.8, 2, 0], 2, 0, 0),
    # lower bound alone (no cap): only w = 0.25 dropped: -0.8 + 4 + 8 = 11.2
    ({"behav_imp_weight_low": 0.5}, 11.2, [0, 0.8, 2, 8], 1, 0, 0),
    # sequence geometric means g0 = sqrt(0.25 * 0.8) = 0.447, g1 = sqrt(2 * 8) = 4
    # [0.5, 5]: sequence 0 dropped, sequence 1 kept with its own token weights: 4 + 8 = 12
    ({"seq_imp_weight_low": 0.5, "seq_imp_weight_high": 5.0, "seq_ids": SEQ}, 12.0, [0, 0, 2, 8], 2, 0, 1),
    # high 3 alone: sequence 1 (g = 4) dropped: 0.25 - 0.8 = -0.55
    ({"seq_imp_weight_high": 3.0, "seq_ids": SEQ}, -0.55, [0.25, 0.8, 0, 0], 2, 0, 1),
    # sequence mask [0.5, 5] then TIS C = 5 on the kept tokens: 4 + 5 = 9
    ({"seq_imp_weight_low": 0.5, "seq_imp_weight_high": 5.0, "seq_ids": SEQ, "behav_imp_weight_cap": 5.0,
      "behav_imp_weight_mode": "truncate"}, 9.0, [0, 0, 2, 5], 2, 1, 1),
])
def test_corrections_against_hand_computed_example(kw, objective, weights, dropped, truncated, seqs):
    loss, grad, stats = _hand(**kw)
    assert loss == pytest.approx(-objective / 4, abs=1e-12)  # divided by the ORIGINAL 4 mask tokens
    # d(-sum w_t * u_t * A_t / N) / d logp_t = -w_t * A_t / N at u = 1
    torch.testing.assert_close(grad, -torch.tensor(weights, dtype=torch.float64) * A / 4, rtol=0, atol=1e-12)
    assert (stats["dropped_tokens"], stats["truncated_tokens"], stats["dropped_sequences"]) == \
        (dropped, truncated, seqs)
    assert stats["tokens"] == 4 and stats["importance_weight_max"] == pytest.approx(8.0)


def test_sequence_mask_on_rows_equals_packed_with_seq_ids():
    g = torch.Generator().manual_seed(3)
    logp, prox, behav, adv = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.5 - 2 for _ in range(4))
    mask = torch.rand(3, 7, generator=g) > 0.2
    objective = PPOObjective(seq_imp_weight_low=0.7, seq_imp_weight_high=1.3)
    rows, st_rows = objective(logp, prox, behav, adv, mask)
    ids = torch.arange(3)[:, None].expand(3, 7).reshape(-1)
    packed, st_packed = objective(*(t.reshape(-1) for t in (logp, prox, behav, adv, mask)), seq_ids=ids)
    assert rows.item() == pytest.approx(packed.item(), abs=1e-12) and st_rows == st_packed
    assert 0 < st_rows["dropped_sequences"] < 3  # the bounds cut, and not everything
    with pytest.raises(ValueError, match="needs seq_ids"):
        objective(*(t.reshape(-1) for t in (logp, prox, behav, adv, mask)))


def test_defaults_reproduce_the_stable_interface():
    # the stable positional call (docs/design.md, "Stable interfaces"), by keyword and as an objective: MIS at the cap
    g = torch.Generator().manual_seed(1)
    logp, prox, behav, adv = (torch.randn(50, generator=g, dtype=torch.float64) - 2 for _ in range(4))
    mask = torch.rand(50, generator=g) > 0.3
    old = decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, 0.28, 1.5)
    new = PPOObjective(eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=1.5,
                       behav_imp_weight_mode="mask")(logp, prox, behav, adv, mask)
    w = torch.exp(prox - behav)
    keep = mask & (w <= 1.5)
    ratio = torch.exp(logp - prox)
    obj = w * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert old[0].item() == new[0].item() == pytest.approx((-(obj * keep).sum() / mask.sum()).item(), abs=1e-12)
    assert old[1] == new[1] and old[1]["dropped_tokens"] == float((mask & ~keep).sum()) > 0


def test_objective_from_config_carries_every_loss_key():
    """The actor builds its loss once from the ``ppo:`` section: every key of the objective comes from the
    section's key of the same name, none keeps its default behind the user's back."""
    cfg = PPOConfig(eps_clip=0.1, eps_clip_high=0.3, behav_imp_weight_cap=3.0, behav_imp_weight_mode="mask",
                    behav_imp_weight_low=0.4, seq_imp_weight_low=0.6, seq_imp_weight_high=5.0)
    objective = PPOObjective.from_config(cfg)
    assert objective == PPOObjective(eps_clip=0.1, eps_clip_high=0.3, behav_imp_weight_cap=3.0,
                                     behav_imp_weight_low=0.4, seq_imp_weight_low=0.6, seq_imp_weight_high=5.0)
    assert objective.per_sequence and not PPOObjective.from_config(PPOConfig()).per_sequence
    loss, stats = objective(*_hand_batch(), seq_ids=SEQ)
    # w = 0.25, 0.8, 2, 8 with A = 1, -1, 2, 1 at u = 1: g0 = 0.447 < 0.6 drops sequence 0; in sequence 1,
    # (g1 = 4 < 5) w = 8 > 3 is dropped: only 2 * 2 = 4 remains, over the 4 mask tokens
    assert loss.item() == pytest.approx(-4.0 / 4, abs=1e-12) and stats["dropped_sequences"] == 1


def _hand_batch():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    return logp, logp, logp - W.log(), A, torch.ones(4, dtype=torch.bool)


def test_config_validation_names_the_key():
    PPOConfig(behav_imp_weight_mode="truncate", behav_imp_weight_cap=2.0, seq_imp_weight_low=0.5,
              seq_imp_weight_high=2.0).validate()
    PPOConfig(behav_imp_weight_low=0.5, behav_imp_weight_cap=2.0).validate()
    for kw, key in [({"behav_imp_weight_mode": "truncate", "behav_imp_weight_cap": None}, "behav_imp_weight_cap"),
                    ({"behav_imp_weight_mode": "clip"}, "behav_imp_weight_mode"),
                    ({"behav_imp_weight_low": 1.5}, "behav_imp_weight_low"),
                    ({"behav_imp_weight_low": 0.5, "behav_imp_weight_mode": "truncate"}, "behav_imp_weight_low"),
                    ({"seq_imp_weight_low": 0.0}, "seq_imp_weight_low"),
                    ({"seq_imp_weight_high": 0.9}, "seq_imp_weight_high")]:
        with pytest.raises(ConfigError, match=f"^{key}:"):
            PPOConfig(**kw).validate()


def test_config_loads_the_options_from_overrides_and_names_the_section():
    from megatron_areal.config import load_config

    cfg = load_config(None, ["ppo.behav_imp_weight_mode=truncate", "ppo.behav_imp_weight_cap=3",
                             "ppo.seq_imp_weight_high=2.5"])
    assert (cfg.ppo.behav_imp_weight_mode, cfg.ppo.behav_imp_weight_cap, cfg.ppo.seq_imp_weight_high) == \
        ("truncate", 3.0, 2.5)
    with pytest.raises(ConfigError, match="ppo.behav_imp_weight_mode"):
        load_config(None, ["ppo.behav_imp_weight_mode=clip"])
    with pytest.raises(ConfigError, match="ppo.seq_imp_weight_low"):
        load_config(None, ["ppo.seq_imp_weight_low=2"])


# ---------------------------------------------------------------- mismatch metrics
def test_mismatch_metrics_hand_computed():
    r = torch.tensor([0.1, -0.2, 0.0, 0.5, 3.0])  # trainer - behaviour logprob per position
    behav = torch.full((5,), -2.0)
    trainer = behav + r
    loss_mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)  # position 4: prompt, ignored
    fresh = torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)  # positions 2, 3: stale tokens
    m = rollout_mismatch_metrics(trainer, behav, loss_mask, fresh)
    assert m["rollout_mismatch_tokens"] == 2
    assert m["rollout_mismatch_abs"] == pytest.approx((0.1 + 0.2) / 2, rel=1e-6)
    k3 = [math.exp(x) - 1 - x for x in (0.1, -0.2)]
    assert m["rollout_mismatch_kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    w = torch.tensor([math.exp(x) for x in (0.1, -0.2, 0.0, 0.5)], dtype=torch.float64)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert m[f"behav_imp_weight_{name}"] == pytest.approx(float(torch.quantile(w, q)), rel=1e-6)
    assert m["behav_imp_weight_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    # no fresh tokens: no mismatch figures (not a misleading 0), quantiles still there
    stale = rollout_mismatch_metrics(trainer, behav, loss_mask, torch.zeros(5, dtype=torch.bool))
    assert stale["rollout_mismatch_tokens"] == 0 and "rollout_mismatch_abs" not in stale
    assert "behav_imp_weight_p50" in stale
    assert quantile(torch.tensor([3.0, 1.0, 2.0]), 0.25) == 1.5


def test_fresh_token_mask_uses_per_token_versions():
    from megatron_areal.actor.ppo_batch import fresh_token_mask
    from megatron_areal.records import Trajectory

    t1 = Trajectory(prompt_ids=[1, 2, 3], output_ids=[4, 5, 6], output_logprobs=[-1.0] * 3,
                    output_versions=[2, 3, 3], start_version=2)
    t2 = Trajectory(prompt_ids=[1, 2], output_ids=[7, 8], output_logprobs=[-1.0] * 2, start_version=3)  # no versions
    assert fresh_token_mask([t1, t2], 3) == [[0, 0, 0, 1, 1], [0, 1, 1]]
    assert fresh_token_mask([t1, t2], 2) == [[0, 0, 1, 0, 0], [0, 0, 0]]
    assert fresh_token_mask([t1, t2], None) == fresh_token_mask([t1, t2], 3)  # newest version in the batch


# ---------------------------------------------------------------- AReaL 1.0.4
def _definitions(path: Path, name: str, symbols: list[str], env: dict[str, object]) -> types.ModuleType:
    """The named top-level definitions of one wheel source file, compiled into a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body, found = [], set()
    for node in tree.body:
        names = {node.name} if isinstance(node, ast.FunctionDef | ast.ClassDef) else set()
        if names & set(symbols):
            body.append(node)
            found |= names
    if missing := set(symbols) - found:
        pytest.fail(f"{path}: areal {AREAL_VERSION} defines no {sorted(missing)} at top level")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__dict__.update({k: getattr(typing, k) for k in typing.__all__})
    mod.__dict__.update(env)
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    sys.modules[name] = mod  # dataclasses look their module up there
    exec(compile(ast.fix_missing_locations(ast.Module(body=[future, *body], type_ignores=[])), str(path), "exec"),  # noqa: S102
         mod.__dict__)
    return mod


@functools.cache
def _areal() -> types.SimpleNamespace:
    import dataclasses

    import numpy as np
    import torch.distributed as dist

    try:
        dist_info = importlib.metadata.distribution("areal")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"areal=={AREAL_VERSION} is not installed; {INSTALL_HINT}")
    if dist_info.version != AREAL_VERSION:
        pytest.fail(f"areal {dist_info.version} is installed; these tests read {AREAL_VERSION}; {INSTALL_HINT}")
    root = Path(str(dist_info.locate_file("areal")))
    dc = {"dataclass": dataclasses.dataclass, "field": dataclasses.field}
    cli = _definitions(root / "api" / "cli_args.py", "_areal_ref.cli_args", ["RejectionSamplingConfig"], dc)
    data = _definitions(root / "utils" / "data.py", "_areal_ref.data", ["KLEstimator"], {"torch": torch})
    fn = _definitions(root / "utils" / "functional" / "functional.py", "_areal_ref.functional",
                      ["RejectionSamplingResult", "_check_bounds", "apply_rejection_sampling", "ppo_actor_loss_fn"],
                      {**dc, "torch": torch, "dist": dist, "np": np, "KLEstimator": data.KLEstimator,
                       "RejectionSamplingConfig": cli.RejectionSamplingConfig})
    return types.SimpleNamespace(config=cli.RejectionSamplingConfig, loss=fn.ppo_actor_loss_fn,
                                 reject=fn.apply_rejection_sampling)


def _random_batch(seed: int, n_seq: int = 6, spread: float = 0.6):
    """A packed batch: per-sequence lengths, cu_seqlens, and log-ratios wide enough to cross the bounds."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n_seq,), generator=g)
    n = int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    logp = prox + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox - spread * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.15
    seq_ids = torch.arange(n_seq).repeat_interleave(lengths)
    return logp, prox, behav, adv, mask, cu, seq_ids


def _both(ours_kw: dict, areal_kw: dict, batch, eps=0.2, eps_high=0.28):
    logp, prox, behav, adv, mask, cu, seq_ids = batch
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours, stats = PPOObjective(eps_clip=eps, eps_clip_high=eps_high, **ours_kw)(a, prox, behav, adv, mask,
                                                                                 seq_ids=seq_ids)
    ref, ref_stats = _areal().loss(b, prox, behav, adv, eps, mask, eps_clip_higher=eps_high, cu_seqlens=cu,
                                   **areal_kw)
    (ga,) = torch.autograd.grad(ours, a)
    (gb,) = torch.autograd.grad(ref, b)
    return ours, ref, ga, gb, stats, ref_stats


# float64 inputs; AReaL rounds w through float32 (1e-7 relative per token, more on a sum that cancels)
RTOL, ATOL = 1e-6, 1e-7
CASES = {  # name: (our keywords, AReaL's rejection_sampling config keywords or None)
    # proximal == behaviour (w = 1): plain PPO; AReaL without rejection sampling
    "naive_ppo": (None, None),
    # MIS, today's default: drop w > C
    "mis": ({"behav_imp_weight_cap": 2.0}, {"level": "token", "action": "mask", "upper": 2.0}),
    # TIS: min(w, C), AReaL's clamp action (its lower bound defaults to 0, i.e. none)
    "tis": ({"behav_imp_weight_cap": 2.0, "behav_imp_weight_mode": "truncate"},
            {"level": "token", "action": "clamp", "upper": 2.0}),
    # icepop-style: drop w outside [L, C]
    "icepop": ({"behav_imp_weight_cap": 2.0, "behav_imp_weight_low": 0.6},
               {"level": "token", "action": "mask", "upper": 2.0, "lower": 0.6}),
    # decoupled PPO with w and no cap: AReaL applies w only through rejection sampling, so the
    # comparable AReaL call is a token mask whose bound no weight reaches
    "uncapped": ({"behav_imp_weight_cap": None}, {"level": "token", "action": "mask", "upper": 1e300}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_areal(case, seed):
    ours_kw, areal_kw = CASES[case]
    batch = _random_batch(seed)
    if ours_kw is None:  # naive PPO: behaviour = proximal
        logp, prox, _, adv, mask, cu, ids = batch
        batch = (logp, prox, prox.clone(), adv, mask, cu, ids)
        ours_kw = {}
    rs = None if areal_kw is None else _areal().config(metric="ratio", **areal_kw)
    ours, ref, ga, gb, stats, ref_stats = _both(ours_kw, {"rejection_sampling": rs}, batch)
    # AReaL forms w in float32 (``.float()`` on the log-ratio) even for float64 inputs: 1e-7 relative
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ga, gb, rtol=RTOL, atol=1e-12)
    assert ga.abs().sum() > 0
    if rs is not None and rs.action == "mask":
        assert stats["dropped_tokens"] / stats["tokens"] == pytest.approx(ref_stats["filtered_fraction"])
        if case != "uncapped":
            assert stats["dropped_tokens"] > 0  # the bounds are exercised
    if case == "tis":
        assert stats["truncated_tokens"] / stats["tokens"] == pytest.approx(ref_stats["filtered_fraction"])
        assert stats["truncated_tokens"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sequence_mask_matches_areal(seed):
    """AReaL's sequence level (metric 'ratio', agg 'mean') decides on the same geometric mean, but
    then weights every kept token by its sequence's geometric mean ``g_s`` where we keep the
    token's own ``w_t``. So: the kept sets must be equal on any input, and the losses and gradients
    equal where ``w`` is constant within each sequence (then ``w_t = g_s``)."""
    logp, prox, behav, adv, mask, cu, ids = _random_batch(seed, n_seq=10, spread=0.5)
    bounds = {"lower": 0.8, "upper": 1.25}
    rs = _areal().config(level="sequence", action="mask", metric="ratio", agg="mean", **bounds)
    ours_kw = {"seq_imp_weight_low": 0.8, "seq_imp_weight_high": 1.25}
    ref = _areal().reject(prox, behav, mask, cu, rs)
    from megatron_areal.algorithm.offpolicy import behaviour_correction

    _, keep, _, st = behaviour_correction(prox, behav, mask, seq_low=0.8, seq_high=1.25, seq_ids=ids)
    assert torch.equal(keep, ref.loss_mask.bool())
    assert 0 < st["dropped_sequences"] < 10
    # one log-ratio per sequence: w_t == g_s, so the losses must agree
    per_seq = 0.3 * torch.randn(10, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    behav_const = prox - per_seq[ids]
    ours, theirs, ga, gb, stats, ref_stats = _both(ours_kw, {"rejection_sampling": rs},
                                                   (logp, prox, behav_const, adv, mask, cu, ids))
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ga, gb, rtol=RTOL, atol=1e-12)
    assert stats["dropped_tokens"] / stats["tokens"] == pytest.approx(ref_stats["filtered_fraction"])


# ---------------------------------------------------------------- the real actor vs the embedded server
TEMPERATURE = 0.7


def _mismatch_run(hf_dir: str) -> dict:
    """Sample with the embedded engine, then train on those samples with the actor holding the
    same weights; returns the mismatch statistics of several update paths."""
    import dataclasses
    import threading

    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel, teardown_parallel
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.records import Trajectory
    from megatron_areal.server.config import EngineOptions
    from megatron_areal.server.engine import Engine
    from megatron_areal.server.sampler import SamplingParams

    engine = Engine(hf_dir, EngineOptions(max_running=8, context_length=64))
    engine.start()
    prompts = [[1, 5, 7, 9, 11], [3, 4, 5], [10, 20, 30, 40, 50, 60, 70], [2, 9], [8, 8, 8, 1], [6, 5, 4, 3, 2]]
    done, finished = {}, threading.Event()

    def on_finish(r):
        done[r.rid] = r
        if len(done) == len(prompts):
            finished.set()

    engine.submit([(str(i), p, SamplingParams(max_new_tokens=14, temperature=TEMPERATURE, ignore_eos=True, seed=i))
                   for i, p in enumerate(prompts)], on_finish)
    assert finished.wait(300), "generation did not finish"
    engine.stop()
    trajs = [Trajectory(prompt_ids=p, output_ids=done[str(i)].output_ids,
                        output_logprobs=done[str(i)].output_logprobs, output_versions=[0] * 14,
                        group_id=i // 3, reward=float(i % 2)) for i, p in enumerate(prompts)]
    # the corrections through the actor's packing: trajectory 0's behaviour logprobs 1 nat higher
    # (g = e^-1 < 0.5: the sequence is dropped), one token of trajectory 2 3 nats lower (w = e^3 > 5:
    # truncated; its sequence's g = e^(3/14) stays inside [0.5, 2])
    shifted = [dataclasses.replace(t, output_logprobs=list(t.output_logprobs)) for t in trajs]
    shifted[0].output_logprobs = [x + 1.0 for x in shifted[0].output_logprobs]
    shifted[2].output_logprobs[0] -= 3.0
    corrections = PPOConfig(n_minibatches=1, behav_imp_weight_cap=5.0, behav_imp_weight_mode="truncate",
                            seq_imp_weight_low=0.5, seq_imp_weight_high=2.0)
    arch = load_arch(hf_dir)
    out = {}
    for name, cfg, version, temp in [("single_minibatch", PPOConfig(n_minibatches=1), 0, TEMPERATURE),
                                     ("two_minibatches", PPOConfig(n_minibatches=2), 0, TEMPERATURE),
                                     ("stale", PPOConfig(n_minibatches=1), 1, TEMPERATURE),
                                     ("wrong_temperature", PPOConfig(n_minibatches=1), 0, 1.0),
                                     ("corrections", corrections, 0, TEMPERATURE)]:
        groups = init_parallel(1, 1, seed=1, backend="gloo")
        actor = Actor(arch, ModelConfig(path=hf_dir, dtype="float32", max_seq_len=64), ParallelConfig(),
                      OptimizerConfig(lr=1e-3), cfg, groups, seed=1, total_steps=2)
        load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
        out[name] = actor.ppo_update(shifted if name == "corrections" else trajs, temp, version=version)
        teardown_parallel()
    return out


def test_mismatch_is_near_zero_on_the_fp32_cpu_path(tiny_llama):
    from megatron_areal.convert.spawn import WorkerPool

    with WorkerPool(1, timeout_s=600) as pool:
        out = pool.run(_mismatch_run, str(tiny_llama))[0]
    n_tokens = 6 * 14
    for name in ("single_minibatch", "two_minibatches"):
        s = out[name]
        assert s["rollout_mismatch_tokens"] == n_tokens
        # measured 1.6e-7 and 4e-14 (float32 rounding between two engines on the same weights)
        assert s["rollout_mismatch_abs"] < 1e-5, name
        assert 0 <= s["rollout_mismatch_kl"] < 1e-10, name
        for key in ("behav_imp_weight_p50", "behav_imp_weight_p90", "behav_imp_weight_p99", "behav_imp_weight_max"):
            assert abs(s[key] - 1) < 1e-5, (name, key)
        assert s["dropped_tokens"] == 0
    # a trainer one version ahead: no token is fresh, so no mismatch figure; the weights still reported
    assert out["stale"]["rollout_mismatch_tokens"] == 0 and "rollout_mismatch_abs" not in out["stale"]
    assert abs(out["stale"]["behav_imp_weight_p50"] - 1) < 1e-4
    # the metric can see a mismatch: trainer at temperature 1.0 vs rollout at 0.7
    bad = out["wrong_temperature"]
    assert bad["rollout_mismatch_abs"] > 1e-2 and bad["rollout_mismatch_kl"] > 1e-4
    assert bad["behav_imp_weight_max"] > 1.01
    fixed = out["corrections"]
    assert (fixed["dropped_sequences"], fixed["dropped_tokens"], fixed["truncated_tokens"]) == (1, 14, 1)
    assert fixed["behav_imp_weight_max"] == pytest.approx(math.exp(3.0), rel=1e-4)
