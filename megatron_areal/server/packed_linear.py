"""Linear layers on the CPU through oneDNN with weights reordered once into its blocked layout, as
vLLM's CPU path does (``dispatch_cpu_unquantized_gemm``: ``create_onednn_mm`` on each weight), and
projections that read the same input fused into one matrix (q/k/v; gate/up), as its
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` do.

``F.linear`` in fp32 calls MKL's sgemm, which re-reads the row-major weight in its own panels on
every call. At a decode step's 32 rows, SmolLM2-135M's shapes on a 2-core AMD EPYC (1 thread,
microseconds per call): gate+up [3072 x 576] 2,799 with F.linear against 1,478 packed, down
[576 x 1536] 739 against 551, the tied lm_head [49,152 x 576] 57,353 against 22,314. Outputs agree
with F.linear to fp32 rounding (the sums are only taken in another order).

The packed copy is derived from the module's own parameters, which stay the model's weights
(state_dict, checksums and weight updates see only them): it is rebuilt on the first call after
any of them changed (an in-place ``copy_`` bumps a tensor's version counter, a new tensor has a
new address). It costs a second copy of the packed weights' memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_usable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can run through the packed oneDNN path: fp32 on a CPU with oneDNN.

    bf16 stays on ``F.linear`` (which already calls oneDNN for bf16 on the CPU), so the
    train/rollout bf16 rounding measured elsewhere is unchanged.
    """
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class FusedLinear:
    """The outputs of linear maps that read the same input, computed as one matmul.

    ``modules``: each has a ``weight`` [out, in] and, optionally, a ``bias`` (an ``nn.Linear``, or an
    ``nn.Embedding`` whose weight is a tied output projection). Not an ``nn.Module``: it holds the
    modules without registering them a second time, so the parameter names stay the checkpoint's.
    """

    def __init__(self, *modules: nn.Module) -> None:
        self.modules = modules
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., sum of out_i]``: the modules' outputs side by side, in order."""
        weights = [m.weight for m in self.modules]
        biases = [getattr(m, "bias", None) for m in self.modules]
        if not onednn_usable(weights[0]):
            outs = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        key = tuple((t.data_ptr(), t._version) for t in weights + biases if t is not None)
        if key != self._key:
            self._pack(weights, biases)
            self._key = key
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self._weight, self._bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _pack(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        present = [b for b in biases if b is not None]
        if present and len(present) != len(biases):
            raise ValueError("fused linear maps must all have a bias or none")
        weight = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        # 32: the rows oneDNN chooses its blocking for, a decode step's batch (vLLM's hint too).
        self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        self._bias = torch.cat([b.detach() for b in present]) if present else None
