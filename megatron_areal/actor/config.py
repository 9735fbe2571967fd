"""Settings of the Megatron actor: the model, its parallel layout and the optimizer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_areal.configbase import require

# the projections an adapter may sit beside, by their HF names (model/mapping.py maps them onto Megatron's
# fused linear_qkv / linear_fc1 and its linear_proj / linear_fc2)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters beside the attention and MLP projections (actor/lora.py); rank 0 trains the whole model.

    The base weights are frozen; only the adapters get gradients and optimizer state. Adapter ``B`` starts at
    zero, so training starts from the base model; the update is ``B @ A * alpha / rank``, as PEFT's."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input during training (PEFT's lora_dropout)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.rank >= 0, "rank", "must be >= 0 (0: no adapters)")
        require(self.alpha > 0, "alpha", "must be > 0")
        require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        require(not unknown, "targets", f"{unknown[0] if unknown else ''!r} is not one of {', '.join(LORA_TARGETS)}")
        require(len(set(self.targets)) == len(self.targets), "targets", "lists a projection twice")
        require(bool(self.targets) or not self.enabled, "targets", "must name at least one projection")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model: where its HF weights come from, its dtype, the longest sequence trained, and the
    Megatron layer spec."""

    path: str = "smollm2-135m"  # HF folder, or a built-in asset name (see megatron_areal.model.assets)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    max_seq_len: int = 1024  # longest prompt + response the trainer accepts
    # Megatron layer spec. auto: Transformer Engine on CUDA (required: a failed import is an error),
    # the local spec on CPU. local: Megatron's local spec everywhere (no sequence parallelism on GPUs).
    # transformer_engine: TE, and refuse to run without CUDA.
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    # MoE models: coefficient of the router's load-balancing loss; None takes the HF config's
    # router_aux_loss_coef, 0 turns the loss off
    router_aux_loss_coef: float | None = None
    # dense models: keep only each transformer layer's input for the backward and recompute the layer
    # there; the same gradients for one more forward (SmolLM2 main-job shapes: step peak about 0.6 GiB
    # lower, +17% time; bench/trainer_memory.py)
    recompute_activations: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0: full fine-tuning

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.max_seq_len > 0, "max_seq_len", "must be positive")
        require(self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0, "router_aux_loss_coef",
                "must be >= 0 (or null for the model's own)")


@dataclass(kw_only=True)
class ParallelConfig:
    """The trainer's parallel layout (TP, PP, EP, ETP, sequence parallel), its backend, and how sequences are
    packed into micro-batches."""

    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (MoE models): ranks the experts are split over, within data parallel
    etp: int = 1  # expert tensor parallel (MoE models): ranks each expert's weights are split over
    sequence_parallel: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with CUDA, else gloo
    max_tokens_per_mb: int = 4096  # token budget of one packed micro-batch (>= model.max_seq_len)
    packing: Literal["ffd", "kk"] = "ffd"  # first-fit-decreasing or Karmarkar-Karp
    # lay out the prompt a group's samples share once per micro-batch, not once per sample
    # (actor/shared_prefix.py; dense models with the local layer spec: not the Transformer Engine's attention)
    share_prompts: bool = True
    # pad each packed micro-batch to a multiple of this many tokens (with sequence parallelism, of its
    # lcm with tp). Kernel libraries keep state per tensor shape (oneDNN's compiled kernels on CPU), so
    # micro-batches of ever new lengths grow the trainer's memory through a run; 64 bounds the shapes
    # (SmolLM2 main job, 8 steps: resident 2.84 -> 3.24 GiB and peak 4.32 -> 5.06 with 1, flat at
    # 2.74 and 4.3 with 64; bench/trainer_memory.py)
    mb_token_multiple: int = 1

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(self.tp >= 1, "tp", "must be >= 1")
        require(self.pp >= 1, "pp", "must be >= 1")
        require(self.ep >= 1, "ep", "must be >= 1")
        require(self.etp >= 1, "etp", "must be >= 1")
        require(self.max_tokens_per_mb > 0, "max_tokens_per_mb", "must be positive")
        require(self.mb_token_multiple >= 1, "mb_token_multiple", "must be >= 1")
        require(not self.sequence_parallel or self.tp > 1, "sequence_parallel", "needs tp > 1")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam, gradient clipping and the learning-rate schedule of the actor."""

    lr: float = 5e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0  # optimizer steps (each training step makes ppo.n_minibatches of them)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # decays to min_lr at the last step
    distributed: bool = True  # Megatron's distributed optimizer (shards state across DP)
    # how bf16 weights follow their fp32 master after each step: nearest (Megatron's), or stochastic,
    # whose expected value is the master, so small lr steps reach the policy (megatron_areal/patches/bf16_rounding.py)
    bf16_rounding: Literal["nearest", "stochastic"] = "nearest"
    # Megatron's precision-aware distributed optimizer (actor/precision_adam.py): the fp32 master weights
    # kept as the bf16 weights plus 16-bit remainders (no fp32 copy), and gradients and Adam moments in the
    # dtypes below; bf16 values are rounded as bf16_rounding says. Bytes per parameter beside the bf16
    # weight: 2 + 2 + 2 + 2 with all three bf16, against 4 + 4 + 4 + 4 (master, gradient, moments).
    precision_aware: bool = False
    main_grads_dtype: Literal["float32", "bfloat16"] = "float32"  # gradient buffer: accumulation and reduction
    exp_avg_dtype: Literal["float32", "bfloat16"] = "float32"
    exp_avg_sq_dtype: Literal["float32", "bfloat16"] = "float32"

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad key; ``load_config`` calls it for every section."""
        require(0 < self.lr <= 1, "lr", "must be in (0, 1]")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        require(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        require(self.adam_eps > 0, "adam_eps", "must be > 0")
        for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            require(self.precision_aware or getattr(self, key) == "float32", key,
                    "other than float32 needs optimizer.precision_aware: true")
        require(not self.precision_aware or self.distributed, "precision_aware", "needs optimizer.distributed: true")
        require(0 <= self.min_lr <= self.lr, "min_lr", "must be between 0 and lr")
        require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
