"""LoRA against full fine-tuning on the main job's model (SmolLM2-135M, ``configs/smollm2_arith.yaml``).

Two arms: full fine-tuning (``--config``, the main job) and LoRA (``--lora-config``, the same job with
``model.lora`` on and its own learning rate, ``configs/smollm2_arith_lora.yaml``). The quick part builds one
trainer rank of each arm the way the main job's trainer does (the actor, the HF weights, the main job's
optimizer and micro-batches, the launcher's allocator), each in its own process, and steps both on the
same batches (``rollout.batch_size`` real arithmetic prompts x ``group_size`` samples, random outputs of up
to ``max_new_tokens`` tokens: bench/trainer_memory.py's), the arms taking turns, the order alternating
each round. It checks first, and prints no RESULT unless all hold (``bench/results.py``):

- the two arms' logprobs of the same batch before any step are equal (the adapters' ``B`` starts at zero, so
  the LoRA model starts as the base model);
- after the steps the LoRA arm's base weights are bit for bit those it loaded, and its adapters moved.

Then, side by side:

    RESULT lora_push_bytes_vs_full    bytes one weight push moves, LoRA over full (target <= 0.02)
    RESULT lora_peak_memory_vs_full   the trainer rank's peak resident set (ru_maxrss), LoRA over full (<= 0.6)
    RESULT lora_step_time_vs_full     median PPO step time after the same warm-up, LoRA over full (<= 1.0)

The push bytes come from the tensors a push sends (weights/gather.py): for full fine-tuning every HF tensor
the push gathers, in the push's dtype; for LoRA the adapter push's whole ``A`` and ``B`` of every targeted
projection (``stage_adapter_tensors``; SGLang still gets merged weights, a full push). With ``--learning``,
where both arms' runs logged ``weights/bytes_pushed`` (the bytes each push really sent), the RESULT is their
ratio instead; the output says which it is.

``--learning`` adds the held-out comparison: the main job itself (``megatron-areal train``) for each seed
of ``--seeds``, full then LoRA, each run's accuracy on the 200 held-out problems before and after and its
wall time printed, and

    RESULT lora_gain_vs_full          LoRA's mean held-out gain over full fine-tuning's (target >= 0.8)

A run takes a few minutes on 2 quiet cores (the main job's figure, docs/benchmarks.md), so this part is
long: 4 seeds are 8 runs. Resumable: each run lives in ``OUT/<arm>-seed<n>`` and a finished one is read
back, not run again.

    python bench/lora.py [--steps 3] [--warmup 1] [--threads 1]
    python bench/lora.py --learning [--seeds 1 2 3 4] [--out runs/lora_bench]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import Results

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("full", "lora")


# ---------------------------------------------------------------------------------------------- worker
def worker(config: str, threads: int) -> None:
    """One trainer rank of one arm, driven over stdin/stdout: one JSON line in, one JSON line out."""
    sys.path.insert(0, str(ROOT))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    from megatron_areal.util.netutil import free_port

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ[k] = v
    import resource

    import torch
    from trainer_memory import main_job_batch
    from transformers import AutoTokenizer

    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.lora import adapters_of
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.config import load_config
    from megatron_areal.data.tasks import load_datasets
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.assets import resolve_model
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.util.heap import release_freed_memory
    from megatron_areal.weights.gather import stage_adapter_tensors, stage_hf_tensors

    torch.set_num_threads(threads)
    out = sys.stdout
    sys.stdout = sys.stderr  # only the protocol's lines on the real stdout

    def reply(**kw) -> None:
        print(json.dumps(kw), file=out, flush=True)

    cfg = load_config(config)
    groups = init_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed, backend=cfg.parallel.backend)
    hf_dir = resolve_model(cfg.model.path)
    arch = load_arch(hf_dir)
    actor = Actor(arch, cfg.model, cfg.parallel, cfg.optimizer, cfg.ppo, groups, seed=cfg.train.seed,
                  total_steps=cfg.train.steps)
    load_hf_weights(actor.model, hf_dir, arch, groups.tp_rank, groups.tp, optimizer=actor.optimizer)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts, _ = load_datasets(cfg.data)
    adapters = [a for a in map(adapters_of, actor.model) if a is not None]

    def batch(seed: int):
        return main_job_batch(tokenizer, prompts, seed, cfg.rollout.batch_size, cfg.rollout.group_size,
                              cfg.rollout.max_new_tokens)

    def base_weights() -> dict[str, torch.Tensor]:
        return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(actor.model) for n, p in c.named_parameters()
                if not p.requires_grad}

    if adapters:  # what the adapter push sends: every targeted projection's whole A and B (PEFT's names)
        push = [t for _, t in stage_adapter_tensors(actor.model, groups)]
    else:  # what a full push sends: every HF tensor, as weights/stage_push.py gathers it
        push = [t for _, t in stage_hf_tensors(actor.model, arch, groups, dtype=actor.dtype)]
    base = base_weights() if adapters else {}
    trainable = sum(p.numel() for c in actor.model for p in c.parameters() if p.requires_grad)
    total = sum(p.numel() for c in actor.model for p in c.parameters())
    reply(ready=True, push_bytes=sum(t.numel() * t.element_size() for t in push), push_tensors=len(push),
          trainable=trainable, total=total, dtype=str(actor.dtype).replace("torch.", ""),
          lora=None if not cfg.model.lora.enabled else vars(cfg.model.lora), lr=cfg.optimizer.lr)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "logprobs":
            lp = actor.compute_logprobs([t.input_ids for t in batch(cmd["seed"])], cfg.rollout.temperature)
            reply(logprobs=[x.float().tolist() for x in lp])
        elif cmd["do"] == "step":
            trajectories = batch(cmd["seed"])
            start = time.perf_counter()
            stats = actor.ppo_update(trajectories, cfg.rollout.temperature, version=cmd["seed"])
            release_freed_memory()  # between steps, as trainer/policy.py does
            reply(seconds=time.perf_counter() - start, tokens=sum(len(t.input_ids) for t in trajectories),
                  loss=stats["loss"], grad_norm=stats["grad_norm"])
        elif cmd["do"] == "finish":
            now = base_weights() if adapters else {}
            changed = [n for n in base if not torch.equal(base[n], now[n])]
            b_norm = sum(float(a.layers[k][t].B.detach().float().norm()) for a in adapters for k in a.layers
                         for t in a.layers[k])
            reply(peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, base_changed=changed,
                  adapter_b_norm=b_norm)
            return


class Arm:
    """A worker process of one arm."""

    def __init__(self, name: str, config: str, threads: int, allocator: str) -> None:
        from megatron_areal.launch.allocator import with_allocator

        env = with_allocator({**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}, allocator)
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", config, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} arm's worker ended (exit {self.proc.wait(timeout=60)}); "
                             "its log is above")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def quick(args, results: Results) -> dict[str, dict]:
    """Both arms' trainer ranks: the equal-start check, push bytes, peak memory and step time."""
    arms = {}
    try:
        for name, config in zip(ARMS, (args.config, args.lora_config), strict=True):
            arms[name] = Arm(name, config, args.threads, args.allocator)
            info = arms[name].info
            print(f"{name:4s} ({config}): {info['trainable']:,} of {info['total']:,} parameters trained, "
                  f"lr {info['lr']:g}, {info['dtype']}; a push sends {info['push_tensors']} tensors, "
                  f"{info['push_bytes'] / 1e6:.2f} MB" + (f"; model.lora {info['lora']}" if info["lora"] else ""),
                  flush=True)
        results.check(arms["lora"].info["lora"] is not None and arms["full"].info["lora"] is None,
                      f"{args.lora_config} must turn model.lora on and {args.config} leave it off")
        # correctness: with B = 0 the LoRA model is the base model, so both arms' logprobs are the same
        before = {name: arm.ask(do="logprobs", seed=10_000)["logprobs"] for name, arm in arms.items()}
        diff = max(abs(a - b) for sa, sb in zip(before["full"], before["lora"], strict=True)
                   for a, b in zip(sa, sb, strict=True))
        print(f"logprobs of one batch before any step, LoRA against full: max |diff| {diff:.2e}")
        results.check(diff <= 1e-6, f"before any step the LoRA arm's logprobs differ from the base model's by "
                                    f"{diff:.2e} (its adapters must start as a zero update)")
        times: dict[str, list[float]] = {name: [] for name in arms}
        for step in range(args.warmup + args.steps):
            order = ARMS if step % 2 == 0 else ARMS[::-1]
            for name in order:
                r = arms[name].ask(do="step", seed=step)
                if step >= args.warmup:
                    times[name].append(r["seconds"])
                print(f"step {step} {'(warm-up) ' if step < args.warmup else ''}{name:4s} {r['seconds']:6.2f} s, "
                      f"{r['tokens']} tokens, loss {r['loss']:+.4f}, grad norm {r['grad_norm']:.3f}", flush=True)
        end = {name: arm.ask(do="finish") for name, arm in arms.items()}
    finally:
        for arm in arms.values():
            arm.close()
    results.check(not end["lora"]["base_changed"],
                  f"the LoRA arm's frozen base weights changed: {end['lora']['base_changed'][:3]}")
    results.check(end["lora"]["adapter_b_norm"] > 0, "the LoRA arm's adapters did not move (every B is zero)")
    print(f"LoRA after {args.warmup + args.steps} steps: adapters' |B| {end['lora']['adapter_b_norm']:.4f}, "
          f"base weights unchanged: {not end['lora']['base_changed']}")
    out = {name: {**arms[name].info, **end[name], "step_s": statistics.median(times[name]), "times": times[name]}
           for name in arms}
    for name in ARMS:
        print(f"{name:4s} peak RSS {gib(out[name]['peak_rss'])}; step median {out[name]['step_s']:.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times[name])})")
    results.add("lora_peak_memory_vs_full", out["lora"]["peak_rss"] / out["full"]["peak_rss"])
    results.add("lora_step_time_vs_full", out["lora"]["step_s"] / out["full"]["step_s"])
    return out


# ---------------------------------------------------------------------------------------------- learning
def learning(args, results: Results) -> dict[str, float] | None:
    """The main job per seed and arm -> each arm's mean bytes a push moved (``weights/bytes_pushed``), or
    None where a run did not log it."""
    from mainjob import RunRecord, run_train

    gains: dict[str, list[float]] = {name: [] for name in ARMS}
    pushed: dict[str, list[float]] = {name: [] for name in ARMS}
    rows = []
    for seed in args.seeds:
        for name, config in zip(ARMS, (args.config, args.lora_config), strict=True):
            if name not in args.arms:
                continue
            run_dir = args.out / f"{name}-seed{seed}"
            wall_file = run_dir / "bench_wall_s.json"
            record = RunRecord.read(run_dir)
            steps = _steps(config)
            if not (record.finished(steps) and wall_file.is_file()):
                print(f"running {name} seed {seed} ({config}) in {run_dir} ...", flush=True)
                wall = run_train(Path(config), run_dir, [f"train.seed={seed}"], timeout=args.run_timeout)
                wall_file.write_text(json.dumps({"wall_s": wall}))
                record = RunRecord.read(run_dir)
            wall = json.loads(wall_file.read_text())["wall_s"]
            acc = {e["label"]: e["accuracy"] for e in record.evals if e.get("label") in ("before", "after")}
            if not results.check({"before", "after"} <= set(acc), f"{run_dir}: no before/after evaluation"):
                continue
            gain = 100 * (acc["after"] - acc["before"])
            gains[name].append(gain)
            per_push = [v for _, v in record.series("weights/bytes_pushed")]
            pushed[name].extend(per_push)
            mb = statistics.mean(v for _, v in record.series("perf/weight_sync_mb")) \
                if record.series("perf/weight_sync_mb") else float("nan")
            rows.append((name, seed, acc["before"], acc["after"], gain, wall, mb))
            print(f"{name:4s} seed {seed}: held-out {100 * acc['before']:.1f}% -> {100 * acc['after']:.1f}% "
                  f"({gain:+.1f}), wall {wall:.0f} s, {mb:.2f} MB a push (perf/weight_sync_mb)", flush=True)
    print("\narm  seed  before -> after (gain)      wall")
    for name, seed, before, after, gain, wall, _ in rows:
        print(f"{name:4s} {seed:4d}  {100 * before:5.1f}% -> {100 * after:5.1f}% ({gain:+5.1f})  "
              f"{int(wall) // 60} min {int(wall) % 60:2d} s")
    if results.check(all(gains.values()), "an arm has no finished run"):
        mean = {name: statistics.mean(g) for name, g in gains.items()}
        print(f"mean gain: full {mean['full']:+.2f} points, LoRA {mean['lora']:+.2f} points over "
              f"{len(gains['full'])} and {len(gains['lora'])} seeds")
        results.check(mean["full"] > 0, f"full fine-tuning gained {mean['full']:+.2f} points on average: "
                                        "a ratio over it says nothing")
        results.add("lora_gain_vs_full", mean["lora"] / mean["full"] if mean["full"] else float("nan"))
    if all(pushed.values()):
        return {name: statistics.mean(v) for name, v in pushed.items()}
    return None


def _steps(config: str) -> int:
    from megatron_areal.config import load_config

    return load_config(config).train.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/smollm2_arith.yaml", help="full fine-tuning (the main job)")
    ap.add_argument("--lora-config", default="configs/smollm2_arith_lora.yaml", help="the same job with LoRA")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per arm first")
    ap.add_argument("--threads", type=int, default=1, help="the trainer's threads (cluster.cpu_threads)")
    ap.add_argument("--allocator", choices=("auto", "mimalloc", "glibc"), default="auto",
                    help="the C allocator, as cluster.cpu_allocator gives the main job's trainer")
    ap.add_argument("--learning", action="store_true", help="also run the main job per seed and arm (long)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--out", type=Path, default=Path("runs/lora_bench"), help="run directories of --learning")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                    help="--learning: run only these arms (the RESULT needs both; finished runs are read back)")
    ap.add_argument("--quick", action=argparse.BooleanOptionalAction, default=True,
                    help="the trainer-rank comparison (--no-quick: only --learning, bytes from the runs' metrics)")
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds one main-job run may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return
    sys.path.insert(0, str(ROOT))
    results = Results("lora")
    arms = quick(args, results) if args.quick else None
    measured = learning(args, results) if args.learning else None
    if measured:
        print(f"bytes a push moved (weights/bytes_pushed, mean over the runs' steps): full "
              f"{measured['full'] / 1e6:.2f} MB, LoRA {measured['lora'] / 1e6:.3f} MB")
        results.add("lora_push_bytes_vs_full", measured["lora"] / measured["full"], digits=4)
    elif arms:
        print(f"bytes a push moves, from the tensors it sends (not a run's weights/bytes_pushed): full "
              f"{arms['full']['push_bytes'] / 1e6:.2f} MB, LoRA {arms['lora']['push_bytes'] / 1e6:.3f} MB")
        results.add("lora_push_bytes_vs_full", arms["lora"]["push_bytes"] / arms["full"]["push_bytes"], digits=4)
    sys.exit(results.emit())


if __name__ == "__main__":
    main()
