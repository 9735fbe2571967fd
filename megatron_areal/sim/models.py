"""Model shapes and the byte/FLOP counts the cost model needs.

Known names resolve to the published Hugging Face ``config.json`` shapes; anything else is read
as an HF folder with ``megatron_areal.convert.arch.load_arch``, so the simulator sizes exactly
the model a real run would load.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_areal.convert.arch import ModelArch, load_arch

BF16_BYTES = 2


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = True

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q = h * self.num_heads * d + (self.num_heads * d if self.qkv_bias else 0)
        kv = 2 * (h * self.num_kv_heads * d + (self.num_kv_heads * d if self.qkv_bias else 0))
        o = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return q + kv + o + mlp + 2 * h  # two RMSNorm weights

    @property
    def params(self) -> int:
        """Total parameters (what is stored, sent and optimised)."""
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return self.num_layers * self.layer_params + emb + head + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters that cost 2 FLOPs per token forward: all layers plus the LM head (the
        input embedding is a lookup, free; a tied head still costs its matmul)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer, bf16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def attn_dim(self) -> int:
        """Width of the attention products (query heads x head_dim)."""
        return self.num_heads * self.head_dim


def _shape(name: str, v: int, h: int, i: int, layers: int, heads: int, kv: int, tie: bool) -> ModelShape:
    return ModelShape(name=name, vocab_size=v, hidden_size=h, intermediate_size=i, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, head_dim=h // heads, tie_word_embeddings=tie)


# Shapes copied from each model's published config.json on the Hugging Face hub.
CATALOGUE: dict[str, ModelShape] = {s.name: s for s in (
    _shape("deepseek-r1-distill-qwen-1.5b", 151936, 1536, 8960, 28, 12, 2, False),
    _shape("deepseek-r1-distill-qwen-7b", 152064, 3584, 18944, 28, 28, 4, False),
    _shape("deepseek-r1-distill-qwen-14b", 152064, 5120, 13824, 48, 40, 8, False),
    _shape("deepseek-r1-distill-qwen-32b", 152064, 5120, 27648, 64, 40, 8, False),
    _shape("qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, True),
    _shape("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, False),
    _shape("qwen2.5-14b", 152064, 5120, 13824, 48, 40, 8, False),
    _shape("qwen2.5-32b", 152064, 5120, 27648, 64, 40, 8, False),
)}
ALIASES = {"1.5b": "deepseek-r1-distill-qwen-1.5b", "7b": "deepseek-r1-distill-qwen-7b",
           "14b": "deepseek-r1-distill-qwen-14b", "32b": "deepseek-r1-distill-qwen-32b"}


def shape_from_arch(name: str, arch: ModelArch) -> ModelShape:
    return ModelShape(name=name, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
                      intermediate_size=arch.intermediate_size, num_layers=arch.num_layers,
                      num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                      tie_word_embeddings=arch.tie_word_embeddings, qkv_bias=arch.qkv_bias)


def resolve_model(path: str) -> ModelShape:
    """A catalogue name (case-insensitive, the last path part of an HF id also works) or an HF folder."""
    key = path.lower().rstrip("/")
    key = ALIASES.get(key, key)
    if key in CATALOGUE:
        return CATALOGUE[key]
    if Path(path).is_dir():
        return shape_from_arch(Path(path).name, load_arch(path))
    tail = key.split("/")[-1]
    if tail in CATALOGUE:
        return CATALOGUE[tail]
    raise ValueError(f"model.path {path!r} is neither a known model ({', '.join(CATALOGUE)}) "
                     "nor a Hugging Face folder with a config.json")
