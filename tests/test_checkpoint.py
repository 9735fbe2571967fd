"""Training checkpoints: resume equals never stopping, and a TP2 PP2 checkpoint resumes at TP1 PP1.

One four-rank pool. Run A (TP2 PP2) loads a tiny Llama, takes a PPO step, saves, then takes a
second step: the uninterrupted reference. Runs B start from a differently seeded model, load the
checkpoint and take the same second step, at TP2 PP2 (must match A exactly, RNG included) and at
TP1 PP1 with four DP ranks (the model and the distributed optimizer resharded, vocabulary padding
256 -> 128; equal to float rounding). A run that loads the model but not the optimizer state must
diverge, which shows the comparison can fail.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_areal.checkpoint.training import latest_checkpoint, list_checkpoints
from megatron_areal.convert.spawn import WorkerPool
from megatron_areal.util.compute_dtype import BF16_ANYWAY_ENV

EVAL = [[3, 17, 40, 41, 42, 90, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100, 2]]


def random_batch(seed: int):
    from megatron_areal.records import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        prompt = torch.randint(4, 120, (5,), generator=g).tolist()
        output = torch.randint(4, 120, (6 + i,), generator=g).tolist()
        out.append(Trajectory(prompt_ids=prompt, output_ids=output, output_logprobs=[-4.85] * len(output),
                              output_versions=[0] * len(output), reward=float(i % 2), group_id=0))
    return out


def _actor(hf_dir: str, tp: int, pp: int, seed: int):
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch

    arch = load_arch(hf_dir)
    groups = init_parallel(tp=tp, pp=pp, backend="gloo", seed=seed)
    actor = Actor(arch, ModelConfig(path=hf_dir, dtype="float32", max_seq_len=64), ParallelConfig(tp=tp, pp=pp),
                  OptimizerConfig(lr=1e-3, distributed=True, lr_schedule="linear"), PPOConfig(), groups,
                  seed=seed, total_steps=10)
    return arch, groups, actor


def run_uninterrupted(hf_dir: str, root: str) -> dict:
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer
    from megatron_areal.model.weights import load_hf_weights

    arch, groups, actor = _actor(hf_dir, 2, 2, seed=1)
    load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
    actor.ppo_update(random_batch(1))
    ckpt = Checkpointer(root, arch, groups, keep=2, hf_dir=hf_dir)
    extra = {"version": 1, "buffer": [t.to_dict() for t in random_batch(7)]}
    ckpt.save(1, actor.model, actor.optimizer, actor.scheduler, extra)
    after_save = {"rand": torch.rand(3), "saved": actor.compute_logprobs(EVAL)}
    actor.ppo_update(random_batch(2))
    after_save["stepped"] = actor.compute_logprobs(EVAL)
    after_save["lr"] = actor.optimizer.param_groups[0]["lr"]
    teardown_parallel()
    return after_save


def run_resumed(hf_dir: str, root: str, tp: int, pp: int, load_optimizer: bool = True) -> dict:
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, tp, pp, seed=5)  # other random weights: all must come from the file
    ckpt = Checkpointer(root, arch, groups, keep=2)
    optimizer, scheduler = (actor.optimizer, actor.scheduler) if load_optimizer else (None, None)
    step, extra = ckpt.load(ckpt.latest(), actor.model, optimizer, scheduler)
    out = {"step": step, "extra": extra, "rand": torch.rand(3), "loaded": actor.compute_logprobs(EVAL)}
    actor.ppo_update(random_batch(2))
    out["stepped"] = actor.compute_logprobs(EVAL)
    out["lr"] = actor.optimizer.param_groups[0]["lr"]
    teardown_parallel()
    return out


def run_keep_latest(hf_dir: str, root: str) -> list[str]:
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, 1, 2, seed=1)
    ckpt = Checkpointer(root, arch, groups, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, actor.model, actor.optimizer, actor.scheduler, {"step": step})
    teardown_parallel()
    return sorted(p.name for p in ckpt.root.iterdir())


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(4, timeout_s=600) as p:
        yield p


@pytest.fixture(scope="module")
def reference(pool, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return root, pool.run(run_uninterrupted, str(tiny_llama), str(root))[0]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_resume_at_same_layout_equals_uninterrupted(pool, tiny_llama, reference):
    root, ref = reference
    results = pool.run(run_resumed, str(tiny_llama), str(root), 2, 2)
    got = results[0]
    assert got["step"] == 1 and got["extra"]["version"] == 1
    assert got["extra"]["buffer"][3]["output_ids"] == random_batch(7)[3].output_ids
    assert _max_diff(got["loaded"], ref["saved"]) == 0.0
    assert _max_diff(got["stepped"], ref["stepped"]) == 0.0
    assert got["lr"] == ref["lr"]
    assert torch.equal(got["rand"], ref["rand"])  # RNG restored
    assert _max_diff(ref["stepped"], ref["saved"]) > 1e-3  # the step really moved the model


def test_tp2pp2_checkpoint_resumes_at_tp1pp1(pool, tiny_llama, reference):
    root, ref = reference
    got = pool.run(run_resumed, str(tiny_llama), str(root), 1, 1)
    for rank_result in got:  # four DP ranks, each with a quarter of the optimizer state
        assert _max_diff(rank_result["loaded"], ref["saved"]) <= 1e-5
        assert _max_diff(rank_result["stepped"], ref["stepped"]) <= 1e-5


def test_optimizer_state_matters(pool, tiny_llama, reference):
    root, ref = reference
    got = pool.run(run_resumed, str(tiny_llama), str(root), 2, 2, False)[0]
    assert _max_diff(got["loaded"], ref["saved"]) == 0.0
    assert _max_diff(got["stepped"], ref["stepped"]) > 1e-4  # fresh Adam moments take another step


def test_keeps_newest_and_ignores_unfinished(pool, tiny_llama, tmp_path):
    (tmp_path / ".step_00000009.tmp").mkdir()  # a save that crashed
    (tmp_path / "step_00000008").mkdir()  # no description file: not a finished checkpoint
    names = pool.run(run_keep_latest, str(tiny_llama), str(tmp_path))[0]
    assert names == ["step_00000002", "step_00000003", "step_00000008"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert latest_checkpoint(tmp_path / "absent") is None


def test_training_checkpoint_converts_to_hf(reference, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_areal.convert.convert import mcore_to_hf

    root, ref = reference
    out = mcore_to_hf(latest_checkpoint(root), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        for seq, megatron_logprobs in zip(EVAL, ref["saved"], strict=True):
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            assert (logp - megatron_logprobs).abs().max().item() <= 1e-4


def _bf16_actor_after_a_step(hf_dir: str, **optimizer):
    """One rank, bf16 weights, stochastic rounding (and ``optimizer``'s other settings), after one PPO step."""
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch

    arch = load_arch(hf_dir)
    os.environ[BF16_ANYWAY_ENV] = "1"  # the bf16 path itself, also on CPUs without native bf16 matmuls
    groups = init_parallel(tp=1, pp=1, backend="gloo", seed=1)
    actor = Actor(arch, ModelConfig(path=hf_dir, dtype="bfloat16", max_seq_len=64), ParallelConfig(),
                  OptimizerConfig(lr=1e-3, bf16_rounding="stochastic", **optimizer), PPOConfig(), groups, seed=1,
                  total_steps=2)
    actor.ppo_update(random_batch(1))
    return arch, groups, actor


def run_state_views_vs_gather(hf_dir: str) -> dict:
    """One rank, bf16 weights: the optimizer state a save describes as views of the optimizer's own
    tensors, against the state Megatron gathers into copies (what it saved before)."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint import dist_ckpt
    from megatron_areal.checkpoint.training import _OPTIMIZER_META
    from megatron_areal.model.weights import unwrap
    from megatron_areal.patches.optimizer_state_views import param_state_as_views

    _, _, actor = _bf16_actor_after_a_step(hf_dir)
    model_sd = dist_ckpt.model_sharded_state_dict([unwrap(c) for c in actor.model])
    out = {"dtype": str(next(actor.model[0].parameters()).dtype), "pairs": []}
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        own = {t.data_ptr() for g in sub.optimizer.param_groups for p in g["params"]
               for t in (p, *(v for v in sub.optimizer.state[p].values() if v.dim()))}
        views = param_state_as_views(sub, model_sd)
        gathered = sub.sharded_param_state_fully_reshardable(model_sd, False, dict(_OPTIMIZER_META))
        for (i, a), (j, b) in zip(sorted(views.items()), sorted(gathered.items()), strict=True):
            for key in sorted(set(a) | set(b)):
                x, y = a[key], b[key]
                same_layout = all(getattr(x, a, None) == getattr(y, a, None)  # factories have no shape
                                  for a in ("global_shape", "global_offset", "axis_fragmentations", "dtype"))
                out["pairs"].append((i == j, type(x) is type(y), x.key == y.key, x.replica_id == y.replica_id,
                                     same_layout, torch.equal(x.data, y.data), x.data.data_ptr() in own))
    teardown_parallel()
    return out


def test_optimizer_state_saved_as_views_equals_megatron_gather(tiny_llama):
    with WorkerPool(1, timeout_s=300) as one:
        got = one.run(run_state_views_vs_gather, str(tiny_llama))[0]
    assert got["dtype"] == "torch.bfloat16"
    assert got["pairs"] and all(all(p) for p in got["pairs"]), got["pairs"]


def run_save_copies(hf_dir: str, root: str) -> dict:
    """One rank, bf16 weights after a step: the bytes of CPU tensors cloned while a checkpoint is saved, and
    the bytes of weights and optimizer state it writes."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _bf16_actor_after_a_step(  # the main job's optimizer settings
        hf_dir, precision_aware=True, main_grads_dtype="bfloat16", exp_avg_dtype="bfloat16",
        exp_avg_sq_dtype="bfloat16")
    cloned = []
    clone = torch.Tensor.clone

    def counting_clone(self, *a, **kw):
        if self.device.type == "cpu":
            cloned.append(self.numel() * self.element_size())
        return clone(self, *a, **kw)

    n_weights = sum(p.numel() for c in actor.model for p in c.parameters())
    torch.Tensor.clone = counting_clone
    try:
        path = Checkpointer(root, arch, groups, keep=1, hf_dir=hf_dir).save(1, actor.model, actor.optimizer,
                                                                             actor.scheduler)
    finally:
        torch.Tensor.clone = clone
    teardown_parallel()
    written = sum(f.stat().st_size for f in path.glob("*.distcp"))
    # what a save writes per parameter: the bf16 weight, the fp32 master, two bf16 moments
    return {"cloned": sum(cloned), "state": n_weights * (2 + 4 + 2 + 2), "written": written}


def test_a_save_writes_the_state_without_copying_it(tiny_llama, tmp_path):
    """Megatron's writer clones every CPU tensor that is a view into a larger storage (torch.save writes a
    view's whole storage): the weights (views of the DDP buffer) and the halves of the SwiGLU input
    projection; for the main job's model that was 0.65 GiB on top of the trainer's peak."""
    with WorkerPool(1, timeout_s=300) as one:
        got = one.run(run_save_copies, str(tiny_llama), str(tmp_path))[0]
    assert got["cloned"] < 0.01 * got["state"], got
    # each tensor written once with its headers (1.15x for this tiny model), not the storage it is a view of (a
    # weight's storage is the whole DDP buffer: that would be about a layer's count of times the state)
    assert got["state"] <= got["written"] < 1.5 * got["state"], got


# ---------------------------------------------------------------- damaged checkpoints and a full disk


def _capture_log(name: str) -> list[str]:
    """Messages of logger ``name`` at INFO and above, collected in this (worker) process."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect())
    return messages


def run_resumed_logged(hf_dir: str, root: str) -> dict:
    messages = _capture_log("megatron_areal.checkpoint.training")
    out = run_resumed(hf_dir, root, 2, 2)
    return {**out, "log": messages}


def _truncate_half(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damaged_copy(intact, root, damaged: str):
    """``root`` with ``intact`` as step 1 and, as step 2, a copy of it with one file cut in half; returns that file."""
    import shutil

    shutil.copytree(intact, root / "step_00000001")
    newest = root / "step_00000002"
    shutil.copytree(intact, newest)
    victim = {"a tensor file": max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size),
              "the tensor index": newest / ".metadata", "the common state": newest / "common.pt"}[damaged]
    _truncate_half(victim)
    return victim


def test_resume_skips_a_truncated_newest_checkpoint(pool, tiny_llama, reference, tmp_path):
    """A node died while the newest checkpoint was copied: resume names it, says why, and takes the
    intact previous one (whose weights are the saved ones)."""
    root, ref = reference
    victim = _damaged_copy(latest_checkpoint(root), tmp_path, "a tensor file")
    got = pool.run(run_resumed_logged, str(tiny_llama), str(tmp_path))[0]
    assert got["step"] == 1
    assert _max_diff(got["loaded"], ref["saved"]) == 0.0
    skipped = [m for m in got["log"] if "step_00000002" in m and "skipp" in m]
    assert skipped and victim.name in skipped[0] and "truncated" in skipped[0], got["log"]


@pytest.mark.parametrize("damaged", ["the tensor index", "the common state"])
def test_checkpoint_with_another_file_cut_short_is_skipped(reference, tmp_path, caplog, damaged):
    from megatron_areal.checkpoint.training import newest_intact_checkpoint

    victim = _damaged_copy(latest_checkpoint(reference[0]), tmp_path, damaged)
    assert newest_intact_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert any("step_00000002" in r.getMessage() and victim.name in r.getMessage() for r in caplog.records)
    _truncate_half(tmp_path / "step_00000001" / victim.name)  # nothing whole is left: refuse, naming both
    with pytest.raises(ValueError, match=r"no checkpoint is whole \(step_00000002: .*; step_00000001: "):
        newest_intact_checkpoint(tmp_path)


def run_save_on_full_disk(hf_dir: str, root: str, filler_mb_after_first: float) -> dict:
    """One rank: save step 1, fill the disk but for part of a checkpoint's size, try to save step 2."""
    from megatron_areal.actor.parallel import teardown_parallel
    from megatron_areal.checkpoint.training import Checkpointer

    arch, groups, actor = _actor(hf_dir, 1, 1, seed=1)
    ckpt = Checkpointer(root, arch, groups, keep=2, hf_dir=hf_dir)
    first = ckpt.save(1, actor.model, actor.optimizer, actor.scheduler, {"step": 1})
    size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    with open(os.path.join(root, "filler"), "wb") as f:  # leave half a checkpoint's room
        f.write(b"\0" * max(0, free - size // 2))
    try:
        ckpt.save(2, actor.model, actor.optimizer, actor.scheduler, {"step": 2})
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads what the user is told
        error = f"{type(e).__name__}: {e}"
    os.remove(os.path.join(root, "filler"))
    names = sorted(p.name for p in ckpt.root.iterdir())
    latest = ckpt.latest()
    teardown_parallel()
    return {"error": error, "names": names, "latest": str(latest), "size": size}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 24 MiB tmpfs: a real filesystem that fills up (mounting needs root; elsewhere the test is skipped)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(tiny_llama, small_tmpfs):
    root = small_tmpfs / "ckpts"
    with WorkerPool(1, timeout_s=300) as one:
        got = one.run(run_save_on_full_disk, str(tiny_llama), str(root), 0.5)[0]
    assert got["error"] is not None, got
    assert "no space left on device" in got["error"].lower() and str(root) in got["error"], got["error"]
    assert got["latest"].endswith("step_00000001"), got
    assert got["names"] == ["step_00000001"], got  # the failed save's temporary folder is gone too
