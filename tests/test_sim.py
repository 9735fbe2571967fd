"""The cluster simulator: cost-model arithmetic, the event logic's invariants (eta, no GPU
booked twice, conservation of groups, determinism, sync == eta 0), the CLI and calibration."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from megatron_areal.config import ConfigError, load_config
from megatron_areal.model.catalogue import CATALOGUE, resolve_arch
from megatron_areal.model.counts import kv_bytes_per_token, param_count, weight_bytes
from megatron_areal.sim.calibrate import calibrate, read_scalars
from megatron_areal.sim.cli import main as simulate_main
from megatron_areal.sim.costs import CostModel, decode_cost, sum_max_linear
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.hardware import gpu_spec
from megatron_areal.sim.result import TRAINER
from megatron_areal.sim.scenario import ScenarioError, from_config

SMALL = [
    "model.path=qwen2.5-1.5b", "cluster.nodes=1", "cluster.gpus_per_node=8", "cluster.gen_fraction=0.75",
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
    assert r.submitted == r.trained + r.dropped + r.running + r.buffered
    assert r.trained == r.scenario.batch_size * r.scenario.sim.steps


def test_non_interruptible_conserves_and_resumes():
    r = simulate(from_config(small("staleness.eta=2", "sim.interruptible=false"), mode="config"))
    assert r.submitted == r.trained + r.dropped + r.running + r.buffered
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
    with pytest.raises(ScenarioError, match="gpus_per_node"):
        from_config(small("cluster.gpus_per_node=0"))
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


def _write_events(run_dir, r) -> None:
    from torch.utils.tensorboard import SummaryWriter

    sc = r.scenario
    sync_s = CostModel(sc.model, sc.gpu, sc.sim).weight_update_time(sc.train_pp, sc.colocated)
    w = SummaryWriter(str(run_dir))
    snaps, prev = r.snapshots, None
    for i, s in enumerate(snaps):
        t0, g0, tr0, gb0, tb0 = (0.0, 0, 0, 0.0, 0.0) if prev is None else (
            prev.time, prev.gen_tokens, prev.trained_tokens, prev.gen_busy, prev.train_busy)
        dt = s.time - t0
        w.add_scalar("perf/step_time_s", dt, i)
        w.add_scalar("perf/gen_tokens_per_s", (s.gen_tokens - g0) / dt, i)
        w.add_scalar("perf/train_tokens_per_s", (s.trained_tokens - tr0) / dt, i)
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


def test_cli_calibrate(tmp_path, capsys):
    truth = from_config(small("staleness.eta=2", "sim.decode_step_overhead_s=0.003"))
    _write_events(tmp_path / "run", simulate(truth))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("staleness:\n  eta: 2\n")
    assert simulate_main([str(cfg), *SMALL, "--calibrate", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "decode_step_overhead_s = 0.00" in out and "step time: measured" in out
    assert simulate_main([str(cfg), *SMALL, "--calibrate", str(tmp_path / "nothing")]) == 2
