"""The Mixture-of-Experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral: a softmax router picks ``top_k``
of ``num_experts`` gated MLPs per token and sums their outputs weighted by the router's
probabilities; Qwen2-MoE adds a shared expert for every token, scaled by a sigmoid gate.

Module names mirror the Hugging Face checkpoint (Qwen3-MoE ``mlp.gate.weight``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral ``block_sparse_moe.gate.weight``,
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``: ``ModelArch.hf_moe_block`` and
``hf_expert_projections``), the per-expert layout HF folders contain and SGLang's weight updates
name, so loading and updating need no name map.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_areal.model.arch import ModelArch
from megatron_areal.server.packed_linear import FusedLinear


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the dense MLP, and each expert of a MoE layer; ``names``: the
    three projections' module names (HF's ``gate_proj``, ``up_proj``, ``down_proj`` unless given)."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> None:
        super().__init__()
        gate, up, down = (nn.Linear(hidden, width, bias=False), nn.Linear(hidden, width, bias=False),
                          nn.Linear(width, hidden, bias=False))
        for name, module in zip(names, (gate, up, down), strict=True):
            self.add_module(name, module)
        self._gate_up, self._down = FusedLinear(gate, up), FusedLinear(down)  # one matmul for gate and up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x).chunk(2, dim=-1)
        return self._down(F.silu(gate) * up)


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(GatedMLP(arch.hidden_size, arch.moe_intermediate_size, arch.hf_expert_projections)
                                     for _ in range(arch.num_experts))
        if arch.shared_expert_intermediate_size:  # Qwen2-MoE
            self.shared_expert = GatedMLP(arch.hidden_size, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def route(self, h_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, K] in the activations' dtype, expert ids [N, K]), most probable first.

        The softmax is taken in fp32 over all experts, then the top k are kept (and renormalised
        to sum to 1 when the model says so).
        """
        probs = F.softmax(self.gate(h_NH), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h_NH.dtype), experts

    def forward(self, x: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; appends this layer's expert ids [N, K] to ``routes`` when given."""
        h_NH = x.reshape(-1, x.shape[-1])
        weights_NK, experts_NK = self.route(h_NH)
        if routes is not None:
            routes.append(experts_NK)
        # Group the (token, choice) pairs by expert, then run each expert once on its tokens.
        flat = experts_NK.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, weights = order // self.top_k, weights_NK.reshape(-1)[order]
        out = torch.zeros_like(h_NH)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                idx = tokens[start:start + n]
                out.index_add_(0, idx, expert(h_NH[idx]) * weights[start:start + n, None])
            start += n
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(h_NH)) * self.shared_expert(h_NH)
        return out.view(x.shape)
