"""Sweeps over the simulator: the generation/training split and eta for one cluster (a plan to
recommend), and throughput against cluster size for both modes (the scaling curve)."""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

from tqdm import tqdm

from megatron_areal.config import Config
from megatron_areal.sim.engine import simulate
from megatron_areal.sim.result import RunResult
from megatron_areal.sim.scenario import ScenarioError, from_config

# eta above 4 costs accuracy in the paper's ablation (AIME24 with decoupled PPO: 42.2 at eta=4,
# 41.0 at 8, 38.7 at 16), so the planner only trades a little speed for a smaller eta.
ETA_CHOICES = (1, 2, 4, 8)
PREFER_SMALL_ETA_WITHIN = 0.03  # a smaller eta wins if it is at most 3% slower


@dataclass(frozen=True)
class PlanPoint:
    gen_fraction: float
    eta: int
    result: RunResult

    @property
    def step_time(self) -> float:
        return self.result.step_time


def split_choices(total_gpus: int, server_tp: int) -> list[float]:
    """Distinct generation shares from 1/4 to 7/8 that the server size can realise."""
    seen, out = set(), []
    for frac in (0.25, 0.375, 0.5, 0.625, 0.75, 0.875):
        gen = round(total_gpus * frac / server_tp) * server_tp
        if 0 < gen < total_gpus and gen not in seen:
            seen.add(gen)
            out.append(frac)
    return out


def _override(cfg: Config, eta: int) -> Config:
    c = copy.deepcopy(cfg)
    c.staleness.eta = eta
    c.staleness.overlap = True
    return c


def sweep(cfg: Config, etas: Iterable[int] = ETA_CHOICES, progress: bool = True) -> list[PlanPoint]:
    total = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    grid = [(f, e) for f in split_choices(total, cfg.server.tp) for e in etas]
    points = []
    for frac, eta in tqdm(grid, desc="sweep split x eta", disable=not progress):
        try:
            sc = from_config(_override(cfg, eta), mode="async", gen_fraction=frac)
        except (ScenarioError, ValueError):
            continue  # e.g. the model does not fit the trainer's share
        points.append(PlanPoint(frac, eta, simulate(sc)))
    return points


def recommend(points: list[PlanPoint]) -> PlanPoint:
    if not points:
        raise ValueError("no feasible plan in the sweep")
    best = min(points, key=lambda p: p.step_time)
    close = [p for p in points if p.step_time <= best.step_time * (1 + PREFER_SMALL_ETA_WITHIN)]
    return min(close, key=lambda p: (p.eta, p.step_time))


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    mode: str
    result: RunResult


SCALE_GPUS = (16, 32, 64, 128, 256, 512)


def scaling(cfg: Config, gpus: Iterable[int] = SCALE_GPUS, progress: bool = True) -> list[ScalePoint]:
    grid = [(n, m) for n in gpus for m in ("async", "sync")]
    out = []
    for n, mode in tqdm(grid, desc="scaling 16-512 GPUs", disable=not progress):
        try:
            sc = from_config(cfg, mode=mode if mode == "sync" else "async", total_gpus=n)
        except (ScenarioError, ValueError):
            continue
        out.append(ScalePoint(n, mode, simulate(sc)))
    return out
