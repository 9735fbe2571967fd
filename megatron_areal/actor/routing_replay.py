"""Rollout routing replay (R3) and the train/rollout routing mismatch, through megatron-core's RouterReplay.

A MoE rollout server can return, per token, the experts it routed the token to in every layer
(SGLang's ``return_routed_experts``; ``Trajectory.routed_experts``: ``(L - 1, layers, top_k)``
int32 for tokens ``0 .. L - 2``). With replay on, the trainer's routers take exactly those experts
(megatron-core's ``RouterReplay`` in ``REPLAY_FORWARD`` mode: the router's probabilities of the
given experts, renormalised the same way) in the proximal and in the training forward, so the
trainer's logprobs are those of the policy that generated the tokens up to numerics. With replay
off, the routers ``RECORD`` their own choice and ``RouteHook.mismatch`` counts the token-layer
routes whose expert set differs from the rollout's.

Positions without a rollout route (each sequence's last token, padding) are replayed to experts
``0 .. top_k - 1``: their outputs feed no logprob (the last position predicts nothing; padding is
its own attention segment). Routes reach each router as its micro-batch rows on this rank: the
stage's layers, and under sequence parallelism this TP rank's contiguous share of the row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_areal.model.weights import layer_offset, unwrap

UNKNOWN = -1


def decode_routes(raw: bytes, n_positions: int, num_layers: int, top_k: int, where: str = "trajectory") -> torch.Tensor:
    """``Trajectory.routed_experts`` bytes as a ``[n_positions, num_layers, top_k]`` long tensor."""
    want = n_positions * num_layers * top_k * 4
    if len(raw) != want:
        raise ValueError(f"{where}: routed_experts holds {len(raw)} bytes, expected {want} "
                         f"({n_positions} positions x {num_layers} layers x top_k {top_k} int32)")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(n_positions, num_layers, top_k).long()


def pack_routes(routes: Sequence[torch.Tensor], seq_ids: Sequence[int], value_index: Sequence[torch.Tensor],
                n_tokens: int, num_layers: int, top_k: int) -> torch.Tensor:
    """``[n_tokens, num_layers, top_k]`` routes of one packed micro-batch, ``UNKNOWN`` where none;
    sequence ``seq_ids[k]``'s routes go to its positions ``value_index[k]`` (PackedMicroBatch)."""
    out = torch.full((n_tokens, num_layers, top_k), UNKNOWN, dtype=torch.long)
    for i, idx in zip(seq_ids, value_index, strict=True):
        out[idx] = routes[i]
    return out


def _routers(chunk: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in unwrap(chunk).modules() if isinstance(m, TopKRouter)]
    if any(r.router_replay is None for r in found):
        raise RuntimeError("routing replay needs the routers built with moe_enable_routing_replay")
    return found


class RouteHook:
    """Per micro-batch: replay the given routes (``replay``) or record and compare (``not replay``)."""

    def __init__(self, replay: bool, top_k: int, tp_rank: int, tp_size: int, sequence_parallel: bool) -> None:
        self.replay, self.top_k = replay, top_k
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel
        self.differing = 0
        self.compared = 0

    def _shard(self, routes: torch.Tensor) -> torch.Tensor:
        if not self.sp or self.tp_size == 1:
            return routes
        return torch.chunk(routes, self.tp_size, dim=0)[self.tp_rank]

    def before(self, chunk: torch.nn.Module, routes: torch.Tensor | None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = _routers(chunk)
        if routes is None:
            for r in routers:
                r.router_replay.clear_router_replay_action()
            return
        first = layer_offset(unwrap(chunk))
        local = self._shard(routes)
        for j, router in enumerate(routers):
            rr = router.router_replay
            rr.clear_indices()
            if self.replay:
                idx = local[:, first + j]
                fill = torch.arange(self.top_k).expand_as(idx)
                rr.set_target_indices(torch.where(idx == UNKNOWN, fill, idx))
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                rr.set_router_replay_action(RouterReplayAction.RECORD)

    def after(self, chunk: torch.nn.Module, routes: torch.Tensor | None) -> None:
        routers = _routers(chunk)
        if routes is not None and not self.replay:
            first = layer_offset(unwrap(chunk))
            local = self._shard(routes)
            for j, router in enumerate(routers):
                got = router.router_replay.get_recorded_indices()
                want = local[:, first + j]
                known = (want != UNKNOWN).all(dim=-1)
                same = (got.sort(dim=-1).values.cpu() == want.sort(dim=-1).values).all(dim=-1)
                self.differing += int((known & ~same).sum())
                self.compared += int(known.sum())
        for r in routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()

    def mismatch(self, group: dist.ProcessGroup | None = None) -> float | None:
        """Fraction of compared token-layer routes that differ, summed over ``group`` (collective)."""
        counts = torch.tensor([self.differing, self.compared], dtype=torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        return float(counts[0] / counts[1]) if counts[1] > 0 else None
