"""The Megatron actor at TP2, PP2, TP2PP2, DP4 and TP2 + sequence parallel equals one process.

One spawned 4-process gloo group is reused for every layout (``init_parallel`` tears down and
re-creates Megatron's groups), and one extra single process computes the reference; both start
together at module setup. Each layout: logprobs of a packed batch, one decoupled-PPO step, and
logprobs after the step, all compared in fp32.
"""
from __future__ import annotations

import os
import queue
import traceback
from typing import Any

import pytest
import torch

from megatron_areal.model.arch import ModelArch
from megatron_areal.util.netutil import free_port

pytestmark = pytest.mark.timeout(600)

ARCHS = {
    # Qwen3-style: q/k norm, tied embeddings (PP syncs the tied weight); qkv bias to exercise it too
    "qwen3": ModelArch(model_type="qwen3", vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, rope_scaling=None, qkv_bias=True, qk_norm=True, tie_word_embeddings=True),
    # Llama-style with llama3 RoPE scaling and an untied output layer
    "llama": ModelArch(model_type="llama", vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, qkv_bias=False, qk_norm=False, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}
LAYOUTS = {  # name: (arch, tp, pp, sequence_parallel); the 4-process world gives dp = 4 / (tp * pp)
    "tp2": ("llama", 2, 1, False),
    "pp2": ("qwen3", 1, 2, False),
    "tp2pp2": ("qwen3", 2, 2, False),
    "dp4": ("llama", 1, 1, False),
    "tp2_sp": ("qwen3", 2, 1, True),
}
TEMPERATURE = 0.7


def _trajectories() -> list[Any]:
    """Two groups whose samples share their prompt (laid out once: parallel.share_prompts) and two
    samples of their own."""
    from megatron_areal.records import Trajectory

    g = torch.Generator().manual_seed(0)
    lengths = {0: 10, 1: 12, 2: 2, 3: 8}
    prompts = {group: torch.randint(0, 500, (p,), generator=g).tolist() for group, p in lengths.items()}
    out = []
    for i, (group, o) in enumerate([(0, 9), (0, 20), (0, 4), (1, 13), (1, 6), (2, 27), (3, 3), (1, 11)]):
        out.append(Trajectory(
            prompt_ids=prompts[group], output_ids=torch.randint(0, 500, (o,), generator=g).tolist(),
            output_logprobs=(-6.2 + 0.3 * torch.randn(o, generator=g)).tolist(),
            group_id=group, reward=float(i % 3 == 0)))
    return out


def _actor(arch_name: str, tp: int, pp: int, sp: bool, budget: int = 48, kl_coef: float = 0.0, share: bool = True):
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.algorithm.config import PPOConfig

    groups = init_parallel(tp, pp, seed=3, backend="gloo")
    return Actor(ARCHS[arch_name], ModelConfig(max_seq_len=40, dtype="float32"),
                 ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, max_tokens_per_mb=budget, share_prompts=share),
                 OptimizerConfig(lr=1e-3, adam_eps=1e-4, clip_grad=1.0, distributed=True),
                 PPOConfig(n_minibatches=2, behav_imp_weight_cap=5.0, kl_coef=kl_coef), groups, seed=3, total_steps=4)


def case_layout(arch_name: str, tp: int, pp: int, sp: bool, share: bool = True) -> dict[str, Any]:
    """Logprobs before, PPO stats, logprobs after, on this rank."""
    from megatron_areal.actor.parallel import teardown_parallel

    trajs = _trajectories()
    actor = _actor(arch_name, tp, pp, sp, share=share)
    seqs = [t.input_ids for t in trajs]
    packed = sum(mb.n_real_tokens for mb in actor._plan(seqs, 1))
    before, entropy = actor.compute_logprobs(seqs, TEMPERATURE, with_entropy=True)
    stats = actor.ppo_update(trajs, TEMPERATURE)
    after = actor.compute_logprobs(seqs, TEMPERATURE)
    teardown_parallel()
    return {"before": [x.tolist() for x in before], "entropy": [x.tolist() for x in entropy],
            "after": [x.tolist() for x in after], "stats": stats, "packed": packed}


def case_reference(arch_name: str) -> dict[str, Any]:
    """Single process: the layout case, plus per-sequence unpacked logprobs and full-vocab checks."""
    from megatron_areal.actor.parallel import teardown_parallel

    out = case_layout(arch_name, 1, 1, False)
    actor = _actor(arch_name, 1, 1, False)
    seqs = [t.input_ids for t in _trajectories()]
    out["unpacked"] = [actor.compute_logprobs([s], TEMPERATURE)[0].tolist() for s in seqs]
    full, full_entropy = [], []
    with torch.no_grad():
        chunk = actor.model[0].module
        for s in seqs:  # plain forward of one unpacked sequence, full (unsharded) vocabulary
            logits = chunk(torch.tensor([s]), torch.arange(len(s))[None], None)[0, :-1, :500]
            logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            full.append(logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0].tolist())
            full_entropy.append((-(logp.exp() * logp).sum(-1)).tolist())
    out["full_vocab"], out["full_entropy"] = full, full_entropy
    teardown_parallel()
    return out


def case_kl() -> dict[str, Any]:
    """KL to a reference snapshot: reference logprobs are the snapshot's, the policy is restored."""
    from megatron_areal.actor.parallel import teardown_parallel

    trajs = _trajectories()
    seqs = [t.input_ids for t in trajs]
    actor = _actor("llama", 1, 1, False, kl_coef=0.5)
    before = actor.compute_logprobs(seqs, TEMPERATURE)
    actor.set_reference()
    first = actor.ppo_update(trajs, TEMPERATURE)
    after = actor.compute_logprobs(seqs, TEMPERATURE)
    reference = actor._reference_logprobs(seqs, TEMPERATURE)
    again = actor.compute_logprobs(seqs, TEMPERATURE)
    second = actor.ppo_update(trajs, TEMPERATURE)
    teardown_parallel()
    as_lists = lambda xs: [x.tolist() for x in xs]  # noqa: E731
    return {"before": as_lists(before), "after": as_lists(after), "reference": as_lists(reference),
            "again": as_lists(again), "kl_first": first["kl"], "kl_second": second["kl"]}


def case_bad_inputs() -> dict[str, str]:
    """The error message of each bad input, or 'no error'."""
    import dataclasses

    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.records import Trajectory

    def message(fn) -> str:
        try:
            fn()
        except Exception as e:  # the test asserts on type name and text
            return f"{type(e).__name__}: {e}"
        return "no error"

    out = {}
    ARCHS["gpt2"] = dataclasses.replace(ARCHS["llama"], model_type="gpt2")
    out["arch"] = message(lambda: _actor("gpt2", 1, 1, False))
    actor = _actor("llama", 1, 1, False, budget=16)
    long = Trajectory(prompt_ids=list(range(30)), output_ids=list(range(15)), output_logprobs=[-1.0] * 15)
    out["too_long_logprobs"] = message(lambda: actor.compute_logprobs([list(range(45))]))
    out["too_long_ppo"] = message(lambda: actor.ppo_update([long]))
    out["over_budget"] = message(lambda: actor.compute_logprobs([list(range(30))]))
    teardown_parallel()
    return out


def _worker(rank: int, world: int, port: int, commands: Any, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while (item := commands.get()) is not None:
        fn, kwargs = item
        try:
            results.put((rank, True, fn(**kwargs)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Group:
    """``world`` spawned processes that run the same function together."""

    def __init__(self, world: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        port = free_port()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.commands[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def submit(self, fn: Any, **kwargs: Any) -> None:
        for q in self.commands:
            q.put((fn, kwargs))

    def collect(self, timeout: float = 300) -> list[Any]:
        out: dict[int, Any] = {}
        while len(out) < len(self.procs):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"ranks {sorted(set(range(len(self.procs))) - set(out))} did not answer") from None
            if not ok:
                self.close(force=True)
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(len(self.procs))]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self.commands, self.procs):
            if p.is_alive() and not force:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def groups():
    four, one = Group(4), Group(1)  # both start now; imports overlap
    one.submit(case_reference, arch_name="qwen3")
    ref = {"qwen3": one.collect()[0]}
    one.submit(case_reference, arch_name="llama")
    ref["llama"] = one.collect()[0]
    for arch in ARCHS:
        one.submit(case_layout, arch_name=arch, tp=1, pp=1, sp=False, share=False)
        ref[f"{arch}_unshared"] = one.collect()[0]
    one.submit(case_bad_inputs)
    ref["errors"] = one.collect()[0]
    one.submit(case_kl)
    ref["kl"] = one.collect()[0]
    one.close()
    yield four, ref
    four.close()


def _close(a: list[list[float]], b: list[list[float]], atol: float) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    worst = max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b))
    assert worst <= atol, f"max difference {worst:.3g} > {atol}"
    return worst


def test_packed_equals_unpacked_and_full_vocab(groups):
    _, ref = groups
    for r in (ref["qwen3"], ref["llama"]):
        _close(r["before"], r["unpacked"], 1e-5)
        _close(r["before"], r["full_vocab"], 1e-5)  # temperature path == log_softmax(logits / T)
        _close(r["entropy"], r["full_entropy"], 1e-4)
        assert r["stats"]["tokens"] == sum(len(t.output_ids) for t in _trajectories())


def test_shared_prompts_equal_each_sample_packed_whole(groups):
    """A group's prompt laid out once gives the logprobs, entropy, PPO step and updated policy of
    every sample packed with its own copy."""
    _, ref = groups
    for arch in ARCHS:
        shared, whole = ref[arch], ref[f"{arch}_unshared"]
        _close(shared["before"], whole["before"], 1e-5)
        _close(shared["entropy"], whole["entropy"], 1e-4)
        _close(shared["after"], whole["after"], 2e-5)
        for key in ("loss", "grad_norm", "clip_fraction", "importance_weight_mean", "tokens"):
            assert shared["stats"][key] == pytest.approx(whole["stats"][key], rel=1e-4, abs=1e-6), (arch, key)
        # groups 0 and 1 (3 samples each) lay out 9 and 11 prompt tokens once, not 3 times (each
        # branch repeats the prompt's last token, which predicts its first)
        assert whole["packed"] - shared["packed"] == 2 * 9 + 2 * 11, (shared["packed"], whole["packed"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(groups, layout):
    four, ref = groups
    arch, tp, pp, sp = LAYOUTS[layout]
    four.submit(case_layout, arch_name=arch, tp=tp, pp=pp, sp=sp)
    results = four.collect()
    want = ref[arch]
    for rank, got in enumerate(results):  # every rank returns every sequence's logprobs
        _close(got["before"], want["before"], 1e-5)
        _close(got["entropy"], want["entropy"], 1e-4)
        _close(got["after"], want["after"], 2e-5)
        for key in ("loss", "grad_norm", "clip_fraction", "importance_weight_mean", "tokens", "dropped_tokens"):
            assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-4, abs=1e-6), (rank, key)
    # the update changed the policy, so matching "after" is not trivially matching "before"
    assert max(abs(a - b) for x, y in zip(want["after"], want["before"]) for a, b in zip(x, y)) > 1e-3


def test_bad_inputs_fail_clearly(groups):
    errors = groups[1]["errors"]
    assert errors["arch"].startswith("UnsupportedModelError: model_type 'gpt2' is not supported")
    assert "sequence 0 has 45 tokens, more than model.max_seq_len=40" in errors["too_long_logprobs"]
    assert "trajectory 0: 45 tokens, more than model.max_seq_len=40" in errors["too_long_ppo"]
    assert "sequence 0 has 30 tokens, more than the micro-batch token budget parallel.max_tokens_per_mb=16" \
        in errors["over_budget"]


def test_kl_reference_is_the_snapshot_and_the_policy_is_restored(groups):
    kl = groups[1]["kl"]
    _close(kl["reference"], kl["before"], 1e-6)  # the snapshot taken before the update
    _close(kl["again"], kl["after"], 0.0)  # swapping the reference in and out leaves the policy intact
    assert max(abs(a - b) for x, y in zip(kl["after"], kl["before"]) for a, b in zip(x, y)) > 1e-3
    # the first mini-batch starts at the reference (KL 0); later ones have moved away from it
    assert 0 < kl["kl_first"] < kl["kl_second"]


def test_advantages_per_group_and_whitened_over_the_batch():
    from megatron_areal.actor.ppo_batch import sequence_advantages, token_advantages
    from megatron_areal.records import Trajectory

    def traj(group: int, reward: float, n_out: int) -> Trajectory:
        return Trajectory(prompt_ids=[1, 2], output_ids=[3] * n_out, output_logprobs=[-1.0] * n_out,
                          group_id=group, reward=reward)

    trajs = [traj(0, 1.0, 2), traj(1, 0.0, 1), traj(0, 0.0, 3), traj(1, 1.0, 2), traj(1, 1.0, 1)]
    adv = sequence_advantages(trajs, "drgrpo")  # groups of different sizes: 2 and 3
    assert adv == pytest.approx([0.5, -2 / 3, -0.5, 1 / 3, 1 / 3])
    per_pos = token_advantages(trajs, adv, normalize=False)
    assert per_pos[2] == pytest.approx([0.0, -0.5, -0.5, -0.5])  # prompt position carries nothing
    white = torch.tensor([v for row in token_advantages(trajs, adv, normalize=True) for v in row])
    mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.bool)
    assert float(white[mask].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(white[mask].std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert float(white[~mask].abs().max()) == 0.0
