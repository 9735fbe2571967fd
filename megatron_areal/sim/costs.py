"""First-principles time of each unit of work: a decode step, a prefill, a training step and a
weight update, from bytes moved and FLOPs done against the published peaks of ``hardware``.

A decode step reads every weight once and the whole KV cache of its batch; it is bound by
whichever of memory traffic and arithmetic takes longer, plus a fixed per-step overhead.
Within a stretch of decoding where no request joins or leaves, the batch ``n`` is fixed and the
total context grows by ``n`` per step, so both bounds are linear in the step index and the time
of ``k`` steps has a closed form (``span_time``).

Mixture-of-Experts models compute with their *active* parameters (``counts.matmul_params``) but
store all experts. A decode step of ``n`` sequences reads the shared weights and the experts its
tokens were routed to: with uniform routing of ``k`` of ``E`` experts, a share
``1 - (1 - k/E)^n`` of them (``n`` is fixed within a stretch, so the closed form holds). The trainer
splits experts over expert parallelism and moves every token's hidden state to its experts and back
in each MoE layer (all-to-all), in each pass of a step: forward and backward, and the proximal
forward when the step has several mini-batches (with one, the training forward yields the proximal
logprobs and the trainer skips it: actor/actor.py ``ppo_update``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_areal.cluster.hardware import GPUSpec
from megatron_areal.cluster.sim_config import SimConfig
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.counts import (
    BF16_BYTES,
    attention_width,
    dispatch_bytes_per_token,
    expert_param_count,
    kv_bytes_per_token,
    matmul_params,
    param_count,
    trainer_state_bytes,
    weight_bytes,
)


def _series(a: float, b: float, j0: int, j1: int) -> float:
    """sum_{j=j0}^{j1-1} (a + b*j)."""
    m = j1 - j0
    if m <= 0:
        return 0.0
    return m * a + b * (j0 + j1 - 1) * m / 2


def sum_max_linear(a: float, b: float, c: float, d: float, k: int) -> float:
    """sum_{j<k} max(a + b*j, c + d*j), exactly (the two lines cross at most once)."""
    if k <= 0:
        return 0.0
    if b == d:
        return _series(a, b, 0, k) if a >= c else _series(c, d, 0, k)
    split = min(k, max(0, math.ceil((c - a) / (b - d))))  # the lines cross at most once

    def upper(j0: int, j1: int) -> float:  # no crossing inside [j0, j1): the midpoint decides
        mid = (j0 + j1 - 1) / 2
        return _series(a, b, j0, j1) if a + b * mid >= c + d * mid else _series(c, d, j0, j1)

    return upper(0, split) + upper(split, k)


@dataclass(frozen=True)
class DecodeCost:
    """Per-step time of one server (``tp`` GPUs) as two lines in (batch, total context)."""

    mem_fixed: float  # s to read the weights every step reads (all of a dense model's)
    mem_per_ctx: float  # s per cached token read
    flop_per_seq: float  # s of matmul per sequence in the batch
    flop_per_ctx: float  # s of attention per cached token
    overhead: float  # s per step that neither bound hides
    mem_experts: float = 0.0  # MoE: s to read every expert once
    expert_share: float = 0.0  # MoE: share of the experts one token is routed to (k / E)

    def weight_read(self, n: int) -> float:
        """s to read the weights a batch of ``n`` uses: the shared ones and the experts hit."""
        if self.mem_experts == 0.0:
            return self.mem_fixed
        return self.mem_fixed + self.mem_experts * (1.0 - (1.0 - self.expert_share) ** max(n, 1))

    def step_time(self, n: int, ctx: float) -> float:
        return self.overhead + max(self.weight_read(n) + self.mem_per_ctx * ctx,
                                   self.flop_per_seq * n + self.flop_per_ctx * ctx)

    def span_time(self, k: int, n: int, ctx: float) -> float:
        """Time of ``k`` steps of a batch of ``n`` whose total context is ``ctx`` at the first."""
        a = self.weight_read(n) + self.mem_per_ctx * ctx
        b = self.mem_per_ctx * n
        c = self.flop_per_seq * n + self.flop_per_ctx * ctx
        d = self.flop_per_ctx * n
        return k * self.overhead + sum_max_linear(a, b, c, d, k)

    def steps_within(self, budget: float, n: int, ctx: float) -> int:
        """Largest k with span_time(k) <= budget."""
        if budget <= 0:
            return 0
        lo, hi = 0, 1
        while self.span_time(hi, n, ctx) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.span_time(mid, n, ctx) <= budget:
                lo = mid
            else:
                hi = mid
        return lo


def decode_cost(model: ModelArch, gpu: GPUSpec, tp: int, sim: SimConfig) -> DecodeCost:
    bw = gpu.hbm_bw * sim.hbm_efficiency * tp
    flops = gpu.bf16_flops * sim.decode_flops_efficiency * tp
    kernels = model.num_layers * sim.kernels_per_layer * sim.kernel_gap_s
    # Two all-reduces per layer (after attention and after the MLP) when the server is sharded.
    allreduce = 2 * model.num_layers * gpu.nvlink_latency_s if tp > 1 else 0.0
    experts = expert_param_count(model) * BF16_BYTES
    return DecodeCost(mem_fixed=(weight_bytes(model) - experts) / bw, mem_per_ctx=kv_bytes_per_token(model) / bw,
                      flop_per_seq=2 * matmul_params(model) / flops,
                      flop_per_ctx=4 * model.num_layers * attention_width(model) / flops,
                      overhead=sim.decode_step_overhead_s + kernels + allreduce,
                      mem_experts=experts / bw,
                      expert_share=model.num_experts_per_tok / model.num_experts if model.is_moe else 0.0)


@dataclass(frozen=True)
class CostModel:
    model: ModelArch
    gpu: GPUSpec
    sim: SimConfig

    def prefill_time(self, tokens: float, sq_sum: float, tp: int) -> float:
        """One forward pass over ``tokens`` new tokens (causal attention: 2*s^2*d per layer)."""
        m = self.model
        flops = 2 * matmul_params(m) * tokens + 2 * m.num_layers * attention_width(m) * sq_sum
        compute = flops / (self.gpu.bf16_flops * self.sim.prefill_mfu * tp)
        weights = weight_bytes(self.model) / (self.gpu.hbm_bw * self.sim.hbm_efficiency * tp)
        return max(compute, weights) + self.sim.decode_step_overhead_s

    def kv_capacity_tokens(self, tp: int, mem_fraction: float) -> int:
        """Tokens of KV cache one server holds: its memory share minus the weights."""
        free = self.gpu.hbm_bytes * mem_fraction * tp - weight_bytes(self.model)
        if free <= 0:
            raise ValueError(f"the model ({weight_bytes(self.model) / 1e9:.1f} GB) does not fit on "
                             f"{tp} x {self.gpu.name} at server.mem_fraction={mem_fraction}; raise server.tp")
        return int(free / kv_bytes_per_token(self.model))

    def train_memory_per_gpu(self, n_gpus: int, tp: int, pp: int, ep: int = 1, etp: int = 1) -> float:
        """Bytes of weights, gradients and Adam state per trainer GPU (distributed optimizer): experts
        split over ETP x EP x PP, everything else over TP x PP (``counts.trainer_state_bytes``)."""
        dp = max(1, n_gpus // (tp * pp))
        return trainer_state_bytes(self.model, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)

    def alltoall_bytes_per_gpu(self, tokens: float, n_gpus: int, ep: int, n_minibatches: int = 1) -> float:
        """Bytes one trainer GPU sends to other EP ranks in one step: its share of the tokens (each
        pipeline stage sees every token for its own layers) times each token's MoE dispatch and
        combine, in the forward, the backward and (several mini-batches) the proximal forward; the
        ``1/ep`` of the copies routed to its own experts stay put. 0 for a dense model or EP 1."""
        if ep <= 1:
            return 0.0
        passes = 3 if n_minibatches > 1 else 2
        return passes * tokens * dispatch_bytes_per_token(self.model) / n_gpus * (ep - 1) / ep

    def alltoall_time(self, tokens: float, n_gpus: int, ep: int, etp: int = 1, gpus_per_node: int = 8,
                      n_minibatches: int = 1) -> float:
        """The step's all-to-all, not overlapped with compute. EP ranks are ``etp`` apart (Megatron's
        rank order), so the EP peers on the same node go over NVLink (half its bidirectional figure
        each way) and the others over the NIC, at the same time."""
        sent = self.alltoall_bytes_per_gpu(tokens, n_gpus, ep, n_minibatches)
        if sent == 0.0:
            return 0.0
        in_node = min(ep, max(1, gpus_per_node // etp))
        nvlink = self.gpu.nvlink_bw / 2 * self.sim.net_efficiency
        net = self.gpu.net_bw * self.sim.net_efficiency
        share = sent / (ep - 1)  # bytes to each peer
        return max(share * (in_node - 1) / nvlink, share * (ep - in_node) / net)

    def train_time(self, tokens: float, sq_sum: float, n_gpus: int, tp: int, pp: int, n_minibatches: int,
                   max_tokens_per_mb: int, ep: int = 1, etp: int = 1, gpus_per_node: int = 8) -> float:
        """One PPO step: forward+backward of every token once (6 FLOPs a parameter a token), split into
        ``n_minibatches`` optimizer steps, after a no-grad forward for the proximal logprobs (2 more)
        when there are several. FLOPs follow the active parameters; MoE layers add their all-to-all
        (``alltoall_time``)."""
        m = self.model
        per_token = 8 if n_minibatches > 1 else 6
        flops = per_token * (matmul_params(m) * tokens + m.num_layers * attention_width(m) * sq_sum)
        compute = flops / (n_gpus * self.gpu.bf16_flops * self.sim.train_mfu)
        compute += self.alltoall_time(tokens, n_gpus, ep, etp, gpus_per_node, n_minibatches)
        dp = max(1, n_gpus // (tp * pp))
        mbs = max(1, math.ceil(tokens / (n_minibatches * dp * max_tokens_per_mb)))
        compute *= 1 + (pp - 1) / mbs  # pipeline fill and drain of each minibatch
        experts = expert_param_count(m)
        shard = (param_count(m) - experts) / (tp * pp)  # what TP x PP splits
        expert_shard = experts / (etp * ep * pp)
        edp = max(1, n_gpus // (etp * ep * pp))  # the ranks that hold the same experts
        # fp32 gradient all-reduce over DP, and over expert DP for the experts (ring); Megatron
        # overlaps it with the backward pass.
        net = self.gpu.net_bw * self.sim.net_efficiency
        grad_sync = 2 * (dp - 1) / dp * 4 * shard / net if dp > 1 else 0.0
        grad_sync += 2 * (edp - 1) / edp * 4 * expert_shard / net if edp > 1 else 0.0
        per_mb = max(compute / n_minibatches, grad_sync)
        adam = (self.sim.optimizer_bytes_per_param * (shard / dp + expert_shard / edp)
                / (self.gpu.hbm_bw * self.sim.hbm_efficiency))
        return n_minibatches * (per_mb + adam)

    def weight_update_time(self, pp: int, colocated: bool) -> float:
        """Trainer -> servers. Split placement: one NCCL broadcast per pipeline stage, pipelined so
        each receiver sees the stage's bytes once at NIC speed. Colocated: an on-device copy."""
        if colocated:
            copy = weight_bytes(self.model) / (self.gpu.hbm_bw * self.sim.hbm_efficiency)
            return copy + self.sim.update_overhead_s
        net = self.gpu.net_bw * self.sim.net_efficiency
        return weight_bytes(self.model) / pp / net + self.sim.update_overhead_s
