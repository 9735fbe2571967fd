"""A LoRA step's backward through the frozen layers allocates no more than the layers' own tensors.

With the base frozen, Megatron-core runs its linear layers' backward through ``LinearWithFrozenWeight``:
``grad_output.matmul(weight)``. The output layer's gradient arrives as a transposed view (``[s, 1, vocab]``
with the sequence stride outermost), which ``torch.matmul`` cannot fold into one matrix product; it then
broadcasts the weight over the sequence and materialises ``[s, vocab, hidden]``. At the main job's shapes
(SmolLM2, 448 tokens) that is a 25 GB allocation: the main job's LoRA trainer was killed by the kernel's OOM
killer in its first step. Here every aten op's output during one LoRA step is recorded (a dispatch mode) and
the largest must stay within twice the largest tensor the math needs (the logits' gradient or a weight).
"""
from __future__ import annotations

import pytest
import torch

from megatron_areal.convert.spawn import WorkerPool

pytestmark = pytest.mark.timeout(600)


def largest_op_output_in_a_lora_step(hf_dir: str) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_areal.actor.actor import Actor
    from megatron_areal.actor.config import LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.algorithm.config import PPOConfig
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.records import Trajectory

    class LargestOutput(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel, self.op = 0, ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.op = t.numel(), str(func)
            return out

    arch = load_arch(hf_dir)
    groups = init_parallel(tp=1, pp=1, backend="gloo", seed=1)
    actor = Actor(arch, ModelConfig(path=hf_dir, dtype="float32", max_seq_len=256,
                                    lora=LoraConfig(rank=4, alpha=8.0)),
                  ParallelConfig(), OptimizerConfig(lr=1e-3, distributed=True), PPOConfig(), groups, seed=1,
                  total_steps=10)
    load_hf_weights(actor.model, hf_dir, arch, 0, 1, optimizer=actor.optimizer)
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(4):
        prompt = torch.randint(4, 120, (20,), generator=g).tolist()
        output = torch.randint(4, 120, (40,), generator=g).tolist()
        batch.append(Trajectory(prompt_ids=prompt, output_ids=output, output_logprobs=[-4.0] * len(output),
                                output_versions=[0] * len(output), reward=float(i % 2), group_id=0))
    tokens = sum(len(t.input_ids) for t in batch)
    with LargestOutput() as seen:
        actor.ppo_update(batch)
    largest_param = max(p.numel() for c in actor.model for p in c.parameters())
    return {"largest": seen.numel, "op": seen.op, "logits": tokens * arch.vocab_size, "param": largest_param}


def test_a_lora_step_materialises_no_tensor_beyond_its_logits_or_weights(tiny_qwen3):
    with WorkerPool(1, timeout_s=500) as pool:
        r = pool.run(largest_op_output_in_a_lora_step, str(tiny_qwen3))[0]
    bound = 2 * max(r["logits"], r["param"])
    assert r["largest"] <= bound, (f"{r['op']} made a {r['largest']:,}-element tensor; the step's logits have "
                                   f"{r['logits']:,} and its largest weight {r['param']:,}")
