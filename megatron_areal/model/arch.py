"""The architecture facts of a supported Hugging Face model, read once from its config.

Every part that builds or maps a model (the Megatron actor, conversion, weight transfer, the
embedded server) reads the same ``ModelArch``, so the families we support are listed here only.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
# Where a MoE family's HF checkpoints keep a layer's router and experts: the layer's module name
# and each expert's (gate, up, down) projections (``{block}.gate.weight``,
# ``{block}.experts.{e}.{projection}.weight``). SGLang's weight updates use the same names.
_HF_MOE_NAMES = {"qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool  # Qwen2: bias on q, k and v projections
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture-of-Experts (Qwen2-MoE, Qwen3-MoE, Mixtral): every layer's MLP is ``num_experts`` experts of width
    # ``moe_intermediate_size``, of which a softmax router picks ``num_experts_per_tok`` per token.
    num_experts: int = 0  # 0: a dense MLP of width ``intermediate_size``
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    router_aux_loss_coef: float = 0.0
    # Qwen2-MoE: beside the routed experts, one shared expert of this width that every token passes
    # through, its output scaled by sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def hf_moe_block(self) -> str:
        """The HF module name of a MoE layer's router and experts (``mlp``, Mixtral ``block_sparse_moe``)."""
        return _HF_MOE_NAMES[self.model_type][0]

    @property
    def hf_expert_projections(self) -> tuple[str, str, str]:
        """The HF names of an expert's gate, up and down projections."""
        return _HF_MOE_NAMES[self.model_type][1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocabulary padded so each of ``tp`` ranks holds an equal, aligned slice."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    scaling = None
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            scaling["rope_type"] = kind
    return float(theta if theta is not None else 10000.0), scaling


def _moe_fields(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if model_type == "mixtral" and cfg.get("sliding_window") is not None \
            and int(cfg["sliding_window"]) < int(cfg.get("max_position_embeddings", 4096)):
        raise UnsupportedModelError(f"{source}: sliding_window {cfg['sliding_window']}: sliding-window attention is "
                                    "not supported (sliding_window null, or at least max_position_embeddings)")
    if model_type == "qwen2_moe" and cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window true: sliding-window attention is not supported")
    sparse_step = int(cfg.get("decoder_sparse_step", 1))
    dense_layers = list(cfg.get("mlp_only_layers") or [])
    if sparse_step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"{source}: decoder_sparse_step {sparse_step} / mlp_only_layers {dense_layers}: only models whose "
            "every layer is a MoE layer (decoder_sparse_step 1, no mlp_only_layers) are supported")
    mixtral = model_type == "mixtral"  # every layer sparse, experts as wide as intermediate_size, always renormalised
    return dict(
        num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size" if mixtral else "moe_intermediate_size"]),
        norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
    )


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config") -> ModelArch:
    """Build a ModelArch from an HF ``config.json`` dict; unsupported families are refused."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelArch(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0) if model_type in MOE_MODEL_TYPES
            else int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(cfg, model_type, source),
        )
    except KeyError as e:
        raise UnsupportedModelError(f"{source}: missing required key {e.args[0]!r}") from None


def load_arch(hf_dir: str | Path) -> ModelArch:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (is {hf_dir} a Hugging Face model folder?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path}: invalid JSON: {e}") from None
    return arch_from_hf_config(cfg, source=str(path))
