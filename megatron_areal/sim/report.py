"""Text the CLI prints: one simulated run, and the sync-vs-async comparison."""
from __future__ import annotations

from megatron_areal.model.counts import active_param_count, param_count
from megatron_areal.sim.costs import CostModel
from megatron_areal.sim.result import RunResult


def staleness_line(r: RunResult) -> str:
    """Share of trained groups by staleness, after warm-up (the pipeline fill skews the first steps)."""
    total = sum(r.steady_staleness.values()) or 1
    parts = [f"{k}: {100 * v / total:.0f}%" for k, v in sorted(r.steady_staleness.items())]
    return ", ".join(parts) + f" (mean {r.staleness_mean():.2f}, max {r.max_staleness})"


def describe(r: RunResult) -> str:
    sc = r.scenario
    lines = [
        f"{sc.label}",
        f"  time per step        {r.step_time:9.1f} s   ({r.step_time * 1000 / 3600:.1f} h per 1,000 steps)",
        f"  generation           {r.gen_tokens_per_s:9.0f} tokens/s on {sc.gen_gpus} GPUs, busy "
        f"{100 * r.gen_utilisation:.0f}%",
        f"  training             {r.train_tokens_per_s:9.0f} tokens/s on {sc.train_gpus} GPUs, busy "
        f"{100 * r.train_utilisation:.0f}%",
        f"  staleness (versions) {staleness_line(r)}",
        f"  groups               submitted {r.submitted}, trained {r.trained}, dropped as stale "
        f"{r.dropped}, filtered {r.discarded}, in flight {r.running}, buffered {r.buffered}; "
        f"KV retractions {r.retracted}",
    ]
    if sc.model.is_moe:
        mem = CostModel(sc.model, sc.gpu, sc.sim).train_memory_per_gpu(sc.train_gpus, sc.train_tp, sc.train_pp,
                                                                        sc.train_ep, sc.train_etp)
        steps = max(r.trained // sc.batch_size, 1)  # batches whose training started
        lines.append(f"  experts (MoE)        {param_count(sc.model) / 1e9:.1f}B parameters, "
                     f"{active_param_count(sc.model) / 1e9:.2f}B active; trainer EP {sc.train_ep} x ETP "
                     f"{sc.train_etp}: {mem / 1e9:.1f} GB of model state and "
                     f"{r.alltoall_bytes_per_gpu / steps / 1e9:.1f} GB of all-to-all per GPU per step")
    return "\n".join(lines)


def compare(async_r: RunResult, sync_r: RunResult) -> str:
    ratio = sync_r.step_time / async_r.step_time
    return (f"async vs sync: {ratio:.2f}x faster per step "
            f"({sync_r.step_time:.1f} s -> {async_r.step_time:.1f} s per step)")
