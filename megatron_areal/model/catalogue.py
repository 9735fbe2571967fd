"""Published models the planner and the simulator know by name, so a laptop can size a cluster run
whose weights it does not have. Anything else is read as an HF folder with ``load_arch``."""
from __future__ import annotations

from pathlib import Path

from megatron_areal.model.arch import ModelArch, load_arch


def _qwen2(v: int, h: int, i: int, layers: int, heads: int, kv: int, tie: bool, theta: float) -> ModelArch:
    return ModelArch(model_type="qwen2", vocab_size=v, hidden_size=h, intermediate_size=i, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=h // heads, max_position_embeddings=131072,
                     rms_norm_eps=1e-6, rope_theta=theta, rope_scaling=None, qkv_bias=True, qk_norm=False,
                     tie_word_embeddings=tie)


# Shapes copied from each model's published config.json on the Hugging Face hub.
CATALOGUE: dict[str, ModelArch] = {
    "deepseek-r1-distill-qwen-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, False, 1e4),
    "deepseek-r1-distill-qwen-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False, 1e4),
    "deepseek-r1-distill-qwen-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, False, 1e6),
    "deepseek-r1-distill-qwen-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, False, 1e6),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, True, 1e6),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, False, 1e6),
    "qwen2.5-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, False, 1e6),
    "qwen2.5-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, False, 1e6),
}
ALIASES = {"1.5b": "deepseek-r1-distill-qwen-1.5b", "7b": "deepseek-r1-distill-qwen-7b",
           "14b": "deepseek-r1-distill-qwen-14b", "32b": "deepseek-r1-distill-qwen-32b"}


def resolve_arch(path: str) -> tuple[str, ModelArch]:
    """``(name, arch)`` of a catalogue name (case-insensitive; the last part of an HF id also works)
    or of an HF folder (named after the folder)."""
    key = ALIASES.get(path.lower().rstrip("/"), path.lower().rstrip("/"))
    tail = key.split("/")[-1]
    if key in CATALOGUE:
        return key, CATALOGUE[key]
    if Path(path).is_dir():
        return Path(path).name, load_arch(path)
    if tail in CATALOGUE:
        return tail, CATALOGUE[tail]
    raise ValueError(f"model.path {path!r} is neither a known model ({', '.join(CATALOGUE)}) "
                     "nor a Hugging Face folder with a config.json")
