"""A tiny random Qwen3-MoE (and Mixtral, Qwen2-MoE) written offline by transformers, for the MoE tests.

8 experts, top-2, 2 layers, hidden 48, 4 query / 2 KV heads of 12, expert width 40, vocabulary
130: sizes that are not powers of two and need padding at TP2. Initialisation is widened from
transformers' std 0.02 so the experts change the logits by more than the tolerances the tests
use, and the router's std is raised so that float noise never flips a top-2 choice (its smallest
gap between the 2nd and 3rd expert is reported by ``router_margin``).
"""
from __future__ import annotations

import base64
from pathlib import Path

import torch


def make_tiny_qwen3_moe(out_dir: str | Path, *, norm_topk_prob: bool = True, seed: int = 0, num_layers: int = 2,
                        tie_word_embeddings: bool = False, router_std: float = 1.0,
                        dtype: torch.dtype = torch.float32, num_experts: int = 8, top_k: int = 2) -> Path:
    """Write the model to ``out_dir``; ``dtype`` is the dtype of the written tensors (bf16: the
    weights every engine loads are exactly representable in bf16, as in released checkpoints)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_areal.model.assets import tiny_tokenizer

    tokenizer = tiny_tokenizer(130)
    config = Qwen3MoeConfig(
        vocab_size=130, hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=num_experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return _initialise_and_save(Qwen3MoeForCausalLM(config), tokenizer, out_dir, router_std, dtype)


def make_tiny_mixtral(out_dir: str | Path, *, seed: int = 0, num_layers: int = 2, router_std: float = 1.0) -> Path:
    """A tiny random Mixtral (8 experts, top-2, expert width 40, Llama attention without QK-norm),
    written by transformers in Mixtral's checkpoint layout (``block_sparse_moe.experts.{e}.w1/w2/w3``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from megatron_areal.model.assets import tiny_tokenizer

    tokenizer = tiny_tokenizer(130)
    config = MixtralConfig(
        vocab_size=130, hidden_size=48, intermediate_size=40, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return _initialise_and_save(MixtralForCausalLM(config), tokenizer, out_dir, router_std, torch.float32)


def make_tiny_qwen2_moe(out_dir: str | Path, *, seed: int = 0, num_layers: int = 2, router_std: float = 1.0) -> Path:
    """A tiny random Qwen2-MoE: 8 routed experts (top-2, width 40, probabilities not renormalised),
    a shared expert of width 56 behind a sigmoid gate, Qwen2's q/k/v bias."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from megatron_areal.model.assets import tiny_tokenizer

    tokenizer = tiny_tokenizer(130)
    config = Qwen2MoeConfig(
        vocab_size=130, hidden_size=48, intermediate_size=96, moe_intermediate_size=40,
        shared_expert_intermediate_size=56, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.01,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return _initialise_and_save(Qwen2MoeForCausalLM(config), tokenizer, out_dir, router_std, torch.float32)


def _initialise_and_save(model, tokenizer, out_dir: str | Path, router_std: float, dtype: torch.dtype) -> Path:
    """Norm weights near 1, routers of std ``router_std``, other matrices of std 0.1; saved in ``dtype``."""
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.to(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


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


@torch.no_grad()
def hf_routes(hf_dir: str | Path, sequence: list[int], router_noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    """The experts transformers routes each position to, ``[L, layers, top_k]``; ``router_noise``
    perturbs the router weights first (a rollout engine whose numerics differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        w = layer.mlp.gate.weight
        w.add_(router_noise * torch.randn(w.shape, generator=g))
    k = model.config.num_experts_per_tok
    logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1)


@torch.no_grad()
def hf_logprobs_with_routes(hf_dir: str | Path, sequence: list[int], routes: torch.Tensor) -> torch.Tensor:
    """transformers' logprobs when every router must pick the given experts ``[L, layers, top_k]``
    (their probabilities from its own softmax, renormalised as the config says)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forced(hidden, gate=gate, chosen=routes[:, i]):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        gate.forward = forced
    ids = torch.tensor([sequence])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


def sample_with_routes(hf_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                       dtype: str | None = None, info: dict | None = None) -> list:
    """Sample each prompt once with the embedded server's engine (in this process), keeping the
    routes it reports; ``Trajectory`` objects as the rollout loop builds them (``routed_experts``:
    SGLang's int32 ``(L - 1, layers, top_k)`` bytes, behaviour version 0). ``dtype``: the engine's
    (its default when None); ``info`` (when given) gets the dtype the engine ran in."""
    import threading

    from megatron_areal.records import Trajectory
    from megatron_areal.server.config import EngineOptions
    from megatron_areal.server.engine import Engine
    from megatron_areal.server.routes import encode_routes
    from megatron_areal.server.sampler import SamplingParams

    opts = EngineOptions(max_running=8, context_length=64, dtype=dtype)
    engine = Engine(str(hf_dir), opts)
    if info is not None:
        info["dtype"] = str(engine.dtype).removeprefix("torch.")
    engine.start()
    done, finished = {}, threading.Event()

    def on_finish(r) -> None:
        done[r.rid] = r
        if len(done) == len(prompts):
            finished.set()

    try:
        engine.submit([(str(i), p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                  ignore_eos=True, seed=i)) for i, p in enumerate(prompts)],
                      on_finish, record_routes=True)
        if not finished.wait(300):
            raise TimeoutError("generation did not finish")
    finally:
        engine.stop()
    out = []
    for i, p in enumerate(prompts):
        r = done[str(i)]
        end = len(p) + len(r.output_ids) - 1
        raw = base64.b64decode(encode_routes(r.routes.rows(0, end)))  # what the rollout client receives
        out.append(Trajectory(prompt_ids=list(p), output_ids=list(r.output_ids),
                              output_logprobs=list(r.output_logprobs), output_versions=[0] * len(r.output_ids),
                              group_id=i // 2, reward=float(i % 2), routed_experts=raw))
    return out
