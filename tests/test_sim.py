"""The cluster simulator: cost-model arithmetic, the event logic's invariants (eta, no GPU
booked twice, conservation of groups, determinism, sync == eta 0), the CLI and calibration."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from megatron_areal.cluster.hardware import gpu_spec
from megatron_areal.config import ConfigError, load_config
from megatron_areal.model.arch import arch_from_hf_config
from megatron_areal.model.catalogue import CATALOGUE, resolve_arch
from megatron_areal.model.counts import (
    BF16_BYTES,
    active_param_count,
    expert_param_count,
    kv_bytes_per_token,
    matmul_params,
    param_count,
    weight_bytes,
)
from megatron_areal.sim.calibrate import _truncated_mean, calibrate, read_scalars
from megatron_areal.sim.cli import main as simulate_main
from megatron_areal.sim.costs import CostModel, decode_cost, sum_max_linear
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.push import update_time
from megatron_areal.sim.result import TRAINER
from megatron_areal.sim.scenario import ScenarioError, from_config

SMALL = [
    "model.path=qwen2.5-1.5b", "model.max_seq_len=8192", "cluster.nodes=1", "cluster.gpus_per_node=8",
    "cluster.gen_fraction=0.75",
    "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=4096",
    "rollout.max_concurrent=1000",
    "server.tp=1", "server.mem_fraction=0.7", "sim.response_mean_tokens=600", "sim.response_sigma=1.2",
    "sim.steps=10", "sim.warmup_steps=2",
]


def small(*extra: str):
    return load_config(None, SMALL + list(extra))


def test_sum_max_linear_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        a, b, c, d = (rng.uniform(-2, 2) for _ in range(4))
        k = rng.randint(0, 40)
        brute = sum(max(a + b * j, c + d * j) for j in range(k))
        assert sum_max_linear(a, b, c, d, k) == pytest.approx(brute)


def test_decode_span_and_bounds():
    m, gpu = CATALOGUE["deepseek-r1-distill-qwen-7b"], gpu_spec("H100")
    sim = load_config(None, []).sim
    dec = decode_cost(m, gpu, 1, sim)
    # A small batch reads the weights once: memory bound, about 15 GB / (3.35 TB/s * 0.8).
    read = (weight_bytes(m) + 1000 * kv_bytes_per_token(m)) / (gpu.hbm_bw * sim.hbm_efficiency)
    assert dec.step_time(1, 1000) == pytest.approx(dec.overhead + read)
    # A huge batch of short contexts is compute bound.
    compute = dec.flop_per_seq * 4096 + dec.flop_per_ctx * 4096
    assert dec.step_time(4096, 4096) == pytest.approx(dec.overhead + compute)
    steps = [dec.step_time(64, 64 * 500 + j * 64) for j in range(300)]
    assert dec.span_time(300, 64, 64 * 500) == pytest.approx(sum(steps))
    assert dec.steps_within(sum(steps[:120]) + 1e-9, 64, 64 * 500) == 120


def test_model_facts_and_hf_folder(tmp_path):
    assert param_count(CATALOGUE["deepseek-r1-distill-qwen-1.5b"]) == pytest.approx(1.777e9, rel=1e-3)
    assert param_count(CATALOGUE["deepseek-r1-distill-qwen-7b"]) == pytest.approx(7.616e9, rel=1e-3)
    cfg = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
           "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    name, arch = resolve_arch(str(tmp_path))
    assert name == tmp_path.name
    assert param_count(arch) == param_count(CATALOGUE["deepseek-r1-distill-qwen-1.5b"])
    with pytest.raises(ValueError, match="neither a known model"):
        resolve_arch("no-such-model")


@pytest.mark.parametrize("eta", [1, 2])
def test_eta_respected_and_groups_conserved(eta):
    r = simulate(from_config(small(f"staleness.eta={eta}"), mode="config"))
    assert r.staleness and r.max_staleness <= eta
    assert max(r.staleness) == eta  # the bound is reached, so the check above has teeth
    assert r.submitted == r.trained + r.dropped + r.discarded + r.running + r.buffered
    assert r.trained == r.scenario.batch_size * r.scenario.sim.steps


def test_non_interruptible_conserves_and_resumes():
    r = simulate(from_config(small("staleness.eta=2", "sim.interruptible=false"), mode="config"))
    assert r.submitted == r.trained + r.dropped + r.discarded + r.running + r.buffered
    assert r.max_staleness <= 2
    assert max(r.versions_per_sample) == 1  # a sample never changes weights mid-way
    ri = simulate(from_config(small("staleness.eta=2"), mode="config"))
    assert max(ri.versions_per_sample) > 1  # interrupted samples resume under new weights


def test_no_gpu_double_booked_split_and_colocated():
    r = simulate(from_config(small("staleness.eta=4"), mode="config"), record_timeline=True)
    names = list(r.timeline.intervals)
    assert TRAINER in names and len(names) > 2
    for name in names:  # each GPU group does one thing at a time
        assert r.timeline.overlaps([name]) == []
    sync = simulate(from_config(small("sim.sync_placement=colocated"), mode="sync"), record_timeline=True)
    assert sync.scenario.colocated and sync.scenario.train_gpus == 8
    for s in (n for n in sync.timeline.intervals if n != TRAINER):
        assert sync.timeline.overlaps([TRAINER, s], kinds={"train", "decode", "prefill"}) == []
    # ... and the check does see overlap where there is some: async servers decode while training.
    assert any(r.timeline.overlaps([TRAINER, s], kinds={"train", "decode"}) for s in names if s != TRAINER)


def test_deterministic_under_seed():
    a = simulate(from_config(small("sim.seed=3"), mode="config"))
    b = simulate(from_config(small("sim.seed=3"), mode="config"))
    c = simulate(from_config(small("sim.seed=4"), mode="config"))
    assert a.step_times == b.step_times and a.staleness == b.staleness
    assert a.step_times != c.step_times


def test_sync_is_eta_zero_without_overlap():
    sync = simulate(from_config(small(), mode="sync"), record_timeline=True)
    eta0 = simulate(from_config(small("staleness.eta=0"), mode="config"), record_timeline=True)
    assert sync.scenario.eta == 0 and not sync.scenario.colocated
    assert sync.step_times == eta0.step_times
    assert set(sync.staleness) == {0}
    servers = [n for n in sync.timeline.intervals if n != TRAINER]
    for s in servers:  # generation never runs while the trainer trains
        assert sync.timeline.overlaps([TRAINER, s], kinds={"train", "decode"}) == []
    asyn = simulate(from_config(small("staleness.eta=2"), mode="config"))
    assert asyn.step_time < sync.step_time


def test_overlap_false_config_is_sync():
    cfg = small("staleness.eta=0", "staleness.overlap=false")
    assert from_config(cfg, mode="config").eta == 0
    assert from_config(cfg, mode="async").eta == 4


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="sim.gpu"):
        small("sim.gpu=TPU")
    with pytest.raises(ConfigError, match="sim.respons"):
        small("sim.respons_mean_tokens=3")
    cpu = from_config(small("cluster.gpus_per_node=0", "server.count=2"))  # a CPU run: one device per process
    assert (cpu.n_servers, cpu.train_gpus, cpu.gpu.name) == (2, 1, "CPU process")
    with pytest.raises(ScenarioError, match="gpus_per_node"):
        from_config(small("cluster.gpus_per_node=0"), total_gpus=0)
    with pytest.raises(ValueError, match="does not fit"):
        simulate(from_config(small("model.path=32b", "server.tp=1")))


def test_cli_prints_prediction_and_plots(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("# every setting comes from the overrides\n")
    rc = simulate_main([str(cfg), *SMALL, "sim.steps=6", "--sweep", "--plots", str(tmp_path / "png"),
                        "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for text in ("time per step", "h per 1,000 steps", "staleness", "async vs sync", "recommended:",
                 "throughput vs GPUs"):
        assert text in out
    assert (tmp_path / "png" / "scaling.png").stat().st_size > 1000
    assert (tmp_path / "png" / "timeline.png").stat().st_size > 1000
    assert simulate_main([str(cfg), "sim.gpu=TPU"]) == 2


def _write_events(run_dir, r, loss_per_token: float = 1.0, extra: dict[str, float] | None = None,
                  totals: dict[str, float] | None = None) -> None:
    """The scalars a trainer logs for the simulated run ``r``: ``loss_per_token`` of every trained token
    counts as trained (the rest are prompt tokens), ``extra`` tags are logged as constants, ``totals`` as
    cumulative counters that reach their value at the last step, growing evenly."""
    from torch.utils.tensorboard import SummaryWriter

    sc = r.scenario
    sync_s = update_time(sc)  # what the engine charged for an update
    w = SummaryWriter(str(run_dir))
    snaps, prev = r.snapshots, None
    for i, s in enumerate(snaps):
        t0, g0, tr0, gb0, tb0 = (0.0, 0, 0, 0.0, 0.0) if prev is None else (
            prev.time, prev.gen_tokens, prev.trained_tokens, prev.gen_busy, prev.train_busy)
        dt = s.time - t0
        w.add_scalar("perf/step_time_s", dt, i)
        w.add_scalar("perf/gen_tokens_per_s", (s.gen_tokens - g0) / dt, i)
        w.add_scalar("perf/train_tokens_per_s", loss_per_token * (s.trained_tokens - tr0) / dt, i)
        for tag, value in (extra or {}).items():
            w.add_scalar(tag, value, i)
        for tag, value in (totals or {}).items():
            w.add_scalar(tag, value * (i + 1) / len(snaps), i)
        w.add_scalar("perf/generator_idle_fraction", 1 - (s.gen_busy - gb0) / (dt * r.scenario.n_servers), i)
        w.add_scalar("perf/trainer_idle_fraction", 1 - (s.train_busy - tb0) / dt, i)
        w.add_scalar("perf/weight_sync_s", sync_s, i)
        prev = s
    w.close()


def test_calibration_recovers_known_overhead(tmp_path):
    truth = from_config(small("staleness.eta=2", "sim.decode_step_overhead_s=0.004", "sim.train_mfu=0.25",
                              "sim.update_overhead_s=1.5"))
    _write_events(tmp_path, simulate(truth))
    scalars = read_scalars(tmp_path)
    assert len(scalars["perf/step_time_s"]) == truth.sim.steps
    start = truth.replace(sim=dataclasses.replace(truth.sim, decode_step_overhead_s=5e-4, train_mfu=0.4))
    cal = calibrate(start, scalars)
    assert cal.fitted["decode_step_overhead_s"] == pytest.approx(0.004, rel=0.15)
    assert cal.fitted["train_mfu"] == pytest.approx(0.25, rel=0.1)
    assert cal.fitted["update_overhead_s"] == pytest.approx(1.5, rel=0.01)
    assert cal.step_time_error < 0.1
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        read_scalars(tmp_path / "empty")


def test_calibration_of_a_prompt_heavy_run_that_discards_groups(tmp_path):
    """The main job on a CPU: short responses after long prompts, and most groups filtered out untrained.
    Its metrics count trained (loss) tokens and the filtered groups; the fit must put both into the
    simulator's terms (every token of a batch; generation that is thrown away) to reproduce the run."""
    truth = from_config(small("staleness.eta=2", "rollout.max_new_tokens=64", "sim.prompt_mean_tokens=120",
                              "sim.response_mean_tokens=40", "sim.response_sigma=1.0", "sim.steps=12",
                              "sim.decode_step_overhead_s=0.004", "sim.train_mfu=0.25",
                              "sim.update_overhead_s=1.5")).replace(discard_fraction=0.6)
    r = simulate(truth)
    assert r.discarded > r.trained  # most finished groups never reach the trainer
    mean_response = _truncated_mean(40, 1.0, 64)
    all_per_loss = (120 + mean_response) / mean_response
    _write_events(tmp_path, r, loss_per_token=1 / all_per_loss, extra={
        "rollout/response_len_mean": mean_response,
        "perf/train_all_tokens_per_s": 100.0 * all_per_loss, "perf/train_compute_tokens_per_s": 100.0},
        totals={"rollout/filtered_groups": r.discarded})
    start = truth.replace(discard_fraction=0.0, sim=dataclasses.replace(
        truth.sim, decode_step_overhead_s=5e-4, train_mfu=0.4, prompt_mean_tokens=400, response_mean_tokens=600))
    cal = calibrate(start, read_scalars(tmp_path))
    assert cal.result.scenario.discard_fraction == pytest.approx(0.6, abs=0.1)
    assert cal.result.scenario.sim.prompt_mean_tokens == pytest.approx(120, rel=0.02)
    assert cal.result.scenario.sim.response_mean_tokens == pytest.approx(40, rel=0.02)
    # (train_mfu itself is not identifiable here: the DP gradient all-reduce bounds these small steps)
    assert cal.result.train_utilisation == pytest.approx(r.train_utilisation, abs=0.1)
    assert cal.step_time_error < 0.15


@pytest.mark.parametrize("run, overrides", [
    # 2-core AMD EPYC (AVX2, fp32), eta 2: one prompt a step on a quiet machine (steps of 6-46 s), and three
    # prompts a step on a loaded one (30-140 s); 20 steps at lr 1e-5, as the config then ran
    ("smollm2_arith_run", ["staleness.eta=2", "rollout.batch_size=1", "train.steps=20"]),
    ("smollm2_arith_batch3_run", ["staleness.eta=2", "rollout.batch_size=3", "train.steps=20"]),
    # 2-core Xeon with AMX (native bf16), as then configured (one prompt a step) but for the 20 steps: steps of
    # 4-15 s
    ("smollm2_arith_amx_run", ["rollout.batch_size=1", "train.steps=20"]),
    # 2-core AMD EPYC with AVX-512 bf16, as then configured (12 steps of one prompt at lr 1.5e-5, no
    # checkpoints): steps of 3-15 s
    ("smollm2_arith_avx512_run", ["rollout.batch_size=1"]),
])
def test_calibration_reproduces_a_real_main_job_on_cpu(run, overrides):
    """The README's main job (configs/smollm2_arith.yaml: two one-thread servers and a one-thread trainer on
    a 2-core machine) as it ran, its per-step metrics kept in tests/data/RUN. The CPU run is
    simulated as it ran, and the calibrated model predicts its mean step time after warm-up within 15%."""
    from pathlib import Path

    cfg = load_config(str(Path(__file__).parents[1] / "configs/smollm2_arith.yaml"), overrides)
    scalars = read_scalars(Path(__file__).parent / "data" / run)
    assert len(scalars["perf/step_time_s"]) == cfg.train.steps
    cal = calibrate(from_config(cfg), scalars)
    assert cal.result.scenario.n_servers == 2 and cal.result.scenario.train_gpus == 1
    # about half of the generated tokens never trained: groups filtered as all-equal (shorter than the kept ones)
    assert 0.4 < cal.result.scenario.discard_fraction < 0.8
    assert cal.step_time_error < 0.15, cal.describe()


def test_cli_calibrate(tmp_path, capsys):
    truth = from_config(small("staleness.eta=2", "sim.decode_step_overhead_s=0.003"))
    _write_events(tmp_path / "run", simulate(truth))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("staleness:\n  eta: 2\n")
    assert simulate_main([str(cfg), *SMALL, "--calibrate", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "decode_step_overhead_s = 0.00" in out and "step time: measured" in out
    assert simulate_main([str(cfg), *SMALL, "--calibrate", str(tmp_path / "nothing")]) == 2


# ---- Mixture-of-Experts: total vs active parameters, expert-parallel memory, all-to-all


@pytest.mark.parametrize("name, total, active, non_embedding", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 29.9e9),  # Qwen's model card: 30.5B, 3.3B activated, 29.9B non-embedding
    ("qwen3-235b-a22b", 235e9, 22e9, 234e9),  # 235B, 22B activated, 234B non-embedding
])
def test_moe_counts_match_the_published_figures(name, total, active, non_embedding):
    m = CATALOGUE[name]
    assert param_count(m) == pytest.approx(total, rel=0.02)
    assert active_param_count(m) == pytest.approx(active, rel=0.03)
    assert param_count(m) - 2 * m.vocab_size * m.hidden_size == pytest.approx(non_embedding, rel=0.01)
    assert resolve_arch(f"Qwen/{name.replace('qwen3', 'Qwen3').replace('-a', '-A').replace('b-', 'B-')}")[0] == name


@pytest.mark.parametrize("hf_id, total, active", [
    ("mistralai/Mixtral-8x7B-v0.1", 46.7e9, 12.9e9),  # Mistral's announcement: 46.7B total, 12.9B per token
    ("Qwen/Qwen2-57B-A14B", 57e9, 14e9),  # the name: 57B, 14B activated
])
def test_mixtral_and_qwen2_moe_counts_match_the_published_figures(hf_id, total, active):
    name, m = resolve_arch(hf_id)
    assert name in CATALOGUE
    assert param_count(m) == pytest.approx(total, rel=0.01)
    assert active_param_count(m) == pytest.approx(active, rel=0.02)


def test_moe_param_count_matches_the_hf_model():
    """Total parameters against transformers' own Qwen3-MoE module; active ones by hand."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                            num_experts_per_tok=2, moe_intermediate_size=24, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    arch = arch_from_hf_config(config.to_dict())
    assert param_count(arch) == sum(p.numel() for p in model.parameters())
    one_expert = 3 * 64 * 24
    assert expert_param_count(arch) == 3 * 6 * one_expert
    assert active_param_count(arch) == param_count(arch) - 3 * (6 - 2) * one_expert
    # FLOPs per token follow the active parameters (plus the LM head; the embedding lookup is free).
    assert matmul_params(arch) == active_param_count(arch) - 500 * 64 - 64


def test_moe_decode_computes_with_active_and_reads_the_experts_hit():
    m, gpu = CATALOGUE["qwen3-30b-a3b"], gpu_spec("H100")
    sim = load_config(None, []).sim
    dec = decode_cost(m, gpu, 2, sim)
    flops = gpu.bf16_flops * sim.decode_flops_efficiency * 2
    assert dec.flop_per_seq == pytest.approx(2 * matmul_params(m) / flops)
    assert matmul_params(m) < 0.15 * param_count(m)  # 3.3B of 30.5B
    bw = gpu.hbm_bw * sim.hbm_efficiency * 2
    experts = expert_param_count(m) * BF16_BYTES / bw
    shared = (weight_bytes(m) - expert_param_count(m) * BF16_BYTES) / bw
    # one sequence reads its 8 of 128 experts per layer; a large batch reads nearly all of them
    assert dec.weight_read(1) == pytest.approx(shared + experts * 8 / 128)
    assert dec.weight_read(2) == pytest.approx(shared + experts * (1 - (120 / 128) ** 2))
    assert dec.weight_read(256) == pytest.approx(weight_bytes(m) / bw, rel=1e-6)
    steps = [dec.step_time(16, 16 * 300 + j * 16) for j in range(200)]
    assert dec.span_time(200, 16, 16 * 300) == pytest.approx(sum(steps))


MOE = ["model.path=qwen3-30b-a3b", "model.max_seq_len=4096", "cluster.nodes=4", "cluster.gpus_per_node=8",
       "cluster.gen_fraction=0.5",
       "parallel.tp=2", "parallel.ep=8", "rollout.batch_size=8", "rollout.group_size=4",
       "rollout.max_new_tokens=2048", "server.engine=sglang", "server.tp=2", "server.mem_fraction=0.85",
       "sim.response_mean_tokens=400", "sim.steps=6", "sim.warmup_steps=2"]


def test_moe_step_has_alltoall_traffic_and_expert_parallel_memory():
    sc = from_config(load_config(None, MOE + ["staleness.eta=2"]))
    assert (sc.train_gpus, sc.train_tp, sc.train_ep) == (16, 2, 8)
    r = simulate(sc)
    assert r.alltoall_bytes_per_gpu > 0
    # all-to-all bytes by hand: every trained token sends 8 copies of its hidden state to its experts and
    # back, in 48 layers, two passes (forward and backward: with one mini-batch the trainer runs no proximal
    # forward); 7 of every 8 copies leave the GPU, spread over its 16 GPUs
    assert sc.n_minibatches == 1
    per_token = 2 * 2 * 48 * 8 * 2048 * BF16_BYTES
    assert r.alltoall_bytes_per_gpu == pytest.approx(r.trained_tokens * per_token * 7 / 8 / 16)
    dense = simulate(from_config(small("staleness.eta=2")))
    assert dense.alltoall_bytes_per_gpu == 0
    cost = CostModel(sc.model, sc.gpu, sc.sim)
    mem = {ep: cost.train_memory_per_gpu(16, 2, 1, ep=ep) for ep in (1, 2, 4, 8)}
    assert mem[1] > mem[2] > mem[4] > mem[8]
    assert mem[8] < 80e9 < mem[1]  # EP is what makes 30B of experts fit an 80 GB GPU
    # the all-to-all is part of the step's time, and slower when EP peers sit on other nodes
    tokens = 1e6
    assert cost.alltoall_time(tokens, 16, 8, gpus_per_node=8) > 0
    assert cost.alltoall_time(tokens, 16, 8, gpus_per_node=4) > cost.alltoall_time(tokens, 16, 8, gpus_per_node=8)
    near, far = (cost.train_time(tokens, tokens * 400, 16, 2, 1, 1, 4096, ep=8, gpus_per_node=g) for g in (8, 4))
    assert far - near == pytest.approx(cost.alltoall_time(tokens, 16, 8, gpus_per_node=4)
                                       - cost.alltoall_time(tokens, 16, 8, gpus_per_node=8))


def test_moe_scenario_refuses_bad_expert_parallelism():
    with pytest.raises(ScenarioError, match=r"parallel.ep \(3\) does not divide the model's 128 experts"):
        from_config(load_config(None, MOE + ["parallel.ep=3", "cluster.nodes=6"]))
    with pytest.raises(ScenarioError, match="qwen2.5-1.5b is dense"):
        from_config(small("parallel.ep=2"))
