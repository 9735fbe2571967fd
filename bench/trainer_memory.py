"""Trainer memory by phase: resident set of one trainer rank with the main job's shapes.

Builds the actor the way ``trainer/policy.py`` does (SmolLM2-135M, ``configs/smollm2_arith.yaml``: bf16
weights, Megatron's distributed optimizer, stochastic bf16 rounding, one rank), then runs PPO steps on
batches of the config's shape (``rollout.batch_size`` real arithmetic prompts x ``group_size`` samples,
random outputs of up to ``max_new_tokens`` tokens), saves checkpoints and loads the last one back (as a
resumed run does), printing after each phase the current resident set (``VmRSS``), the phase's own peak
(``VmHWM``, reset before each phase through ``/proc/self/clear_refs``) and the process peak
(``perf/trainer_peak_rss_gb`` logs ``ru_maxrss``, which that reset clears too, so the bench keeps the
maximum itself), and the most memory glibc's ``malloc`` had handed out during the phase: what a resident
peak holds beyond that (less the libraries' ~0.35 GiB) is freed memory the C heap kept.
Measured at c37df5c, 3 steps: a resident peak of 4.35 GiB where ``malloc`` never had more
than 3.26 GiB out, so about 0.7 GiB of the peak was freed heap; with mimalloc preloaded instead of
glibc's allocator the peak was 3.75 GiB. So, like the launcher (``cluster.cpu_allocator``,
launch/allocator.py), the bench preloads mimalloc where it is installed (``--allocator glibc``: not).
With the main job's precision-aware optimizer (bf16 gradients and moments, masters as remainders) and
768-token micro-batches, at 2905101 (fresh clone, quiet, 4 steps and a save): step peaks 2.45-2.51 GiB,
the save 2.57 GiB, 1.85 GiB between steps. Loading the checkpoint back peaked at 4.87 GiB while Megatron read
the optimizer state into new fp32 whole-model tensors (and the optimizer reallocated its own); loading
into the optimizer's own tensors instead (checkpoint/training.py), 2.71 GiB.
After each step and save the bench releases freed heap memory as the trainer does (megatron_areal/util/heap.py)
unless ``--glibc-defaults``. No rollout servers: the weight push is not measured,
nor rank 0's rollout controller and reward pool.

    python bench/trainer_memory.py [--steps 2] [--saves 1] [--threads 2] [--config configs/smollm2_arith.yaml]
                                   [--glibc-defaults] [--allocator auto|mimalloc|glibc] [key=value ...]

The last line is ``RESULT trainer_peak_rss_gb <process peak in GiB>``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package from this checkout

_T0 = time.monotonic()


def _status(key: str) -> float:
    """A ``/proc/self/status`` size in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


_PEAK = [0.0]  # the process peak: clearing VmHWM also clears ru_maxrss, so it is kept here


class _MallocInUse:
    """The most bytes glibc's ``malloc`` had handed out and not got back (``mallinfo2``: in use in
    every arena plus mapped blocks), sampled every 5 ms by a thread. Beside the resident peak it shows
    how much of that peak was memory already freed but still held by the C heap (fragmentation)."""

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    def __init__(self) -> None:
        self.peak = 0.0
        if "libmimalloc" in os.environ.get("LD_PRELOAD", ""):  # glibc's counters would say nothing
            self._mallinfo2 = None
            return
        try:
            self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
            self._mallinfo2.restype = self._Info
        except (OSError, AttributeError):  # not glibc 2.33+
            self._mallinfo2 = None
            return
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> float:
        info = self._mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**30

    def take_peak(self) -> float:
        if self._mallinfo2 is None:
            return float("nan")
        peak, self.peak = max(self.peak, self.now()), 0.0
        return peak

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)


_IN_USE = _MallocInUse()


def phase(name: str) -> None:
    """Print the resident set now, the peak since the previous phase and the process peak (GiB), and
    the most memory ``malloc`` had handed out during the phase."""
    peak = max(_status("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    _PEAK[0] = max(_PEAK[0], peak)
    print(f"{name:<28} rss {_status('VmRSS'):6.2f}  phase peak {peak:6.2f}  "
          f"process peak {_PEAK[0]:6.2f}  malloc out, phase max {_IN_USE.take_peak():5.2f}  GiB  "
          f"({time.monotonic() - _T0:5.0f} s)", flush=True)
    _reset_peak()


def main_job_batch(tokenizer, prompts, seed: int, n_prompts: int, group: int, max_new: int):
    """``n_prompts`` x ``group`` trajectories on real prompts, random outputs of 8..``max_new`` tokens
    (about half at the cap, as the main job's early steps), rewards split in every group."""
    from megatron_areal.data.template import encode_prompt
    from megatron_areal.records import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(n_prompts):
        ids = encode_prompt(tokenizer, prompts[rng.randrange(len(prompts))], True)
        for k in range(group):
            n = max_new if rng.random() < 0.5 else rng.randint(8, max_new)
            output = [rng.randrange(tokenizer.vocab_size) for _ in range(n)]
            out.append(Trajectory(prompt_ids=ids, output_ids=output,
                                  output_logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n)],
                                  output_versions=[0] * n, group_id=g, reward=float(k % 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_arith.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value, as for megatron-areal train")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--saves", type=int, default=1, help="checkpoints saved after the steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="skip the trainer's release of freed memory (megatron_areal/util/heap.py)")
    ap.add_argument("--allocator", choices=("auto", "mimalloc", "glibc"), default="auto",
                    help="the C allocator, as cluster.cpu_allocator gives the main job's trainer (default auto)")
    args = ap.parse_args()
    from megatron_areal.launch.allocator import with_allocator

    env = with_allocator(dict(os.environ), args.allocator)
    if env.get("LD_PRELOAD", "") != os.environ.get("LD_PRELOAD", ""):  # preloading needs a fresh process
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    print(f"allocator: {'mimalloc' if 'libmimalloc' in env.get('LD_PRELOAD', '') else 'glibc'}")
    torch_threads = str(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", torch_threads)
    from megatron_areal.util.netutil import free_port

    port = str(free_port())
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    _reset_peak()
    phase("start")
    import torch
    from transformers import AutoTokenizer

    from megatron_areal.actor import actor as actor_mod
    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.checkpoint.training import Checkpointer
    from megatron_areal.config import load_config
    from megatron_areal.data.tasks import load_datasets
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.assets import resolve_model
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.util.heap import release_freed_memory
    torch.set_num_threads(args.threads)
    phase("import")

    def release() -> None:  # between steps and after a save, as trainer/policy.py does
        if not args.glibc_defaults:
            release_freed_memory()

    cfg = load_config(args.config, args.overrides)
    groups = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed, backend=cfg.parallel.backend)
    hf_dir = resolve_model(cfg.model.path)
    arch = load_arch(hf_dir)
    build_train_state = actor_mod.build_train_state

    def timed_train_state(*a, **kw):
        phase("model build")
        return build_train_state(*a, **kw)

    actor_mod.build_train_state = timed_train_state
    actor = Actor(arch, cfg.model, cfg.parallel, cfg.optimizer, cfg.ppo, groups, seed=cfg.train.seed,
                  total_steps=cfg.train.steps)
    actor_mod.build_train_state = build_train_state
    phase("optimizer build")
    load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
    phase("HF weights loaded")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    train_prompts, _ = load_datasets(cfg.data)
    phase("tokenizer + data")

    step = actor.optimizer.step

    def timed_step():
        phase("  forward+backward")
        out = step()
        return out

    actor.optimizer.step = timed_step
    for i in range(args.steps):
        batch = main_job_batch(tokenizer, train_prompts, i, cfg.rollout.batch_size, cfg.rollout.group_size,
                               cfg.rollout.max_new_tokens)
        if i == 0:
            lengths = sorted(len(t.input_ids) for t in batch)
            print(f"batch: {len(batch)} sequences, {sum(lengths)} tokens, lengths {lengths[0]}..{lengths[-1]}")
        actor.compute_logprobs([t.input_ids for t in batch], cfg.rollout.temperature)
        phase(f"step {i + 1} forward only")
        stats = actor.ppo_update(batch, cfg.rollout.temperature, version=i)
        release()
        phase(f"  optimizer step ({stats['n_microbatches']:.0f} mb)")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, arch, groups, keep=1, hf_dir=hf_dir)
        for k in range(args.saves):
            ckpt.save(args.steps + k, actor.model, actor.optimizer, actor.scheduler, extra={"version": 1})
            release()
            phase(f"checkpoint save {k + 1}")
        if args.saves:  # a resumed run loads into the optimizer it has just built; here, the one it has
            ckpt.load(ckpt.latest(), actor.model, actor.optimizer, actor.scheduler)
            release()
            phase("checkpoint load")
    if args.saves:
        batch = main_job_batch(tokenizer, train_prompts, 99, cfg.rollout.batch_size, cfg.rollout.group_size,
                               cfg.rollout.max_new_tokens)
        actor.ppo_update(batch, cfg.rollout.temperature, version=args.steps)
        phase("step after save")
    print(f"RESULT trainer_peak_rss_gb {_PEAK[0]:.2f}")


if __name__ == "__main__":
    main()
