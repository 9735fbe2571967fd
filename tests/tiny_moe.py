"""A tiny random Qwen3-MoE written offline by transformers, for the MoE tests.

8 experts, top-2, 2 layers, hidden 48, 4 query / 2 KV heads of 12, expert width 40, vocabulary
130: sizes that are not powers of two and need padding at TP2. Initialisation is widened from
transformers' std 0.02 so the experts change the logits by more than the tolerances the tests
use, and the router's std is raised so that float noise never flips a top-2 choice (its smallest
gap between the 2nd and 3rd expert is reported by ``router_margin``).
"""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_qwen3_moe(out_dir: str | Path, *, norm_topk_prob: bool = True, seed: int = 0, num_layers: int = 2,
                        tie_word_embeddings: bool = False, router_std: float = 1.0) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_areal.assets import tiny_tokenizer

    tokenizer = tiny_tokenizer(130)
    config = Qwen3MoeConfig(
        vocab_size=130, hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def hf_logprobs(hf_dir: str | Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per-token logprobs of each sequence under transformers (fp32), one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


@torch.no_grad()
def router_margin(hf_dir: str | Path, sequences: list[list[int]]) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    gaps = []
    for seq in sequences:
        out = model(torch.tensor([seq]), output_router_logits=True)
        for logits in out.router_logits:
            top = torch.topk(logits.float(), k + 1, dim=-1).values
            gaps.append((top[:, k - 1] - top[:, k]).min())
    return float(torch.stack(gaps).min())
