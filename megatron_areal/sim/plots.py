"""PNG figures (matplotlib, no display): throughput against GPU count for both modes, and the
timeline of a few steps of each mode."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron_areal.sim.planner import ScalePoint  # noqa: E402
from megatron_areal.sim.result import TRAINER, RunResult  # noqa: E402

COLOURS = {"decode": "tab:blue", "prefill": "tab:orange", "update": "tab:red", "train": "tab:green",
           "send": "tab:purple"}


def plot_scaling(points: list[ScalePoint], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("async", "o-"), ("sync", "s--")):
        pts = sorted((p.gpus, p.result.train_tokens_per_s) for p in points if p.mode == mode)
        if pts:
            ax.plot([g for g, _ in pts], [t / 1e3 for _, t in pts], style, label=mode)
    if points:
        base = min(points, key=lambda p: (p.gpus, p.mode != "async"))
        gpus = sorted({p.gpus for p in points})
        ideal = [base.result.train_tokens_per_s / 1e3 * g / base.gpus for g in gpus]
        ax.plot(gpus, ideal, ":", color="grey", label="linear from smallest async")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("trained tokens/s (thousands)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rows(r: RunResult, max_servers: int) -> list[str]:
    servers = sorted((k for k in r.timeline.intervals if k != TRAINER), key=lambda k: int(k[6:]))
    return [TRAINER] + servers[:max_servers]


def plot_timelines(runs: list[tuple[str, RunResult]], path: Path, steps: int = 4,
                   max_servers: int = 8) -> Path:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 0.35 * (max_servers + 1) * len(runs)),
                             squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs):
        w = r.scenario.sim.warmup_steps
        t0 = r.snapshots[w - 1].time if w > 0 else 0.0
        t1 = r.snapshots[min(len(r.snapshots) - 1, w - 1 + steps)].time
        rows = _rows(r, max_servers)
        for y, res in enumerate(rows):
            for s, e, kind in r.timeline.intervals.get(res, []):
                if e > t0 and s < t1:
                    ax.broken_barh([(max(s, t0), min(e, t1) - max(s, t0))], (y - 0.4, 0.8),
                                   color=COLOURS.get(kind, "grey"))
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.set_xlim(t0, t1)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {steps} steps after warm-up", fontsize=9)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", fontsize=7, ncol=len(COLOURS))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
