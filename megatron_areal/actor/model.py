"""Build Megatron ``GPTModel`` chunks for the Llama / Qwen2 / Qwen3 dense families and Qwen3-MoE.

``build_model`` returns the chunk(s) of this rank's pipeline stage (one chunk: no virtual
pipeline). On CPU, and on GPU with ``model.transformer_impl=local``, the local spec is used with
``PackedCoreAttention`` so packed (THD) micro-batches work; otherwise on GPU the TE spec is used
(its attention handles THD natively), and a TE that fails to import is an error.

State-dict names of one chunk (local spec; ``L`` is the layer index local to the stage, the
first stage holds ``embedding``, the last ``decoder.final_layernorm`` and ``output_layer``):

    embedding.word_embeddings.weight                         [padded_vocab/tp, hidden]
    decoder.layers.L.input_layernorm.weight                  [hidden]
    decoder.layers.L.self_attention.linear_qkv.weight        [(nq + 2 nkv) * head_dim / tp, hidden]
    decoder.layers.L.self_attention.linear_qkv.bias          (qwen2 / attention_bias only)
    decoder.layers.L.self_attention.q_layernorm.weight       [head_dim]  (qwen3 only)
    decoder.layers.L.self_attention.k_layernorm.weight       [head_dim]  (qwen3 only)
    decoder.layers.L.self_attention.linear_proj.weight       [hidden, nq * head_dim / tp]
    decoder.layers.L.pre_mlp_layernorm.weight                [hidden]
    decoder.layers.L.mlp.linear_fc1.weight                   [2 * ffn / tp, hidden]  (gate; up)
    decoder.layers.L.mlp.linear_fc2.weight                   [hidden, ffn / tp]
    decoder.final_layernorm.weight                           [hidden]
    output_layer.weight                                      [padded_vocab/tp, hidden]  (untied only)

``*._extra_state`` entries (Transformer Engine FP8 metadata, empty here) also appear in the state
dict; they carry no weights. ``linear_qkv`` rows are grouped per KV head: for each of the ``nkv`` groups, its
``nq / nkv`` query heads, then one key head, then one value head (head_dim rows each); TP splits
whole groups. ``linear_fc1`` on each TP rank is ``[gate_shard; up_shard]``. With the TE spec the
input/pre-MLP norms are fused into the next linear and are named
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` instead.

A Qwen3-MoE layer replaces ``mlp.linear_fc1/2`` by Megatron's MoE layer with SequentialMLP experts
(one MLP per local expert; grouped GEMMs need TE or CUDA kernels) and the all-to-all dispatcher:

    decoder.layers.L.mlp.router.weight                                 [num_experts, hidden]
    decoder.layers.L.mlp.experts.local_experts.J.linear_fc1.weight     [2 * moe_ffn / etp, hidden]
    decoder.layers.L.mlp.experts.local_experts.J.linear_fc2.weight     [hidden, moe_ffn / etp]

``J`` counts the ``num_experts / ep`` experts of this expert-parallel rank; its first expert's global
index is ``ep_rank * num_experts / ep``. The router is a softmax over all experts; HF's
``norm_topk_prob`` (renormalise the chosen top-k) is Megatron's softmax after top-k
(``moe_router_pre_softmax=False``), without it the top-k of the full softmax (``True``).
"""
from __future__ import annotations

import logging
import zlib

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_areal.actor.attention import PackedCoreAttention
from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.actor.swiglu import SwiGLU
from megatron_areal.model import mapping
from megatron_areal.model.arch import SUPPORTED_MODEL_TYPES, ModelArch, UnsupportedModelError
from megatron_areal.model.rope import rope_inv_freq
from megatron_areal.model.weights import expert_offset
from megatron_areal.patches import packed_rope
from megatron_areal.patches.moe_router import ensure_router_gemm_fallback
from megatron_areal.util.compute_dtype import runnable_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype the actor trains in for ``model.dtype = name`` on ``device``.

    ``auto`` is bf16 on CUDA, fp32 on CPU. ``bfloat16`` on a CPU without native bf16 matmuls is
    trained in fp32 (with a warning): it is many times faster there and, with fp32 gradients and no
    separate fp32 master copy, takes less memory than bf16 weights plus fp32 master weights.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return runnable_dtype(DTYPES[name], device, "model.dtype")


def te_import_error() -> str | None:
    """Why ``transformer_engine.pytorch`` does not import here, or None when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # TE fails to import in many ways without a matching CUDA/torch build
        return f"{type(e).__name__}: {e}"
    return None


def te_available() -> bool:
    return te_import_error() is None and torch.cuda.is_available()


def use_transformer_engine(impl: str, *, on_gpu: bool, sequence_parallel: bool = False) -> bool:
    """Whether to build the TE layer spec for ``model.transformer_impl = impl``.

    On CUDA the TE spec is required unless the config opts out with ``local``: falling back silently
    hid broken TE installs until Megatron's torch norm asserted on sequence parallelism.
    """
    if impl not in ("auto", "transformer_engine", "local"):
        raise ValueError(f"model.transformer_impl: {impl!r} is not auto, transformer_engine or local")
    if not on_gpu:
        if impl == "transformer_engine":
            raise ValueError("model.transformer_impl=transformer_engine needs a CUDA device; "
                             "use auto or local on CPU")
        return False
    if impl == "local":
        if sequence_parallel:
            raise ValueError("parallel.sequence_parallel needs Transformer Engine on CUDA (Megatron's local "
                             "spec uses torch norms, which refuse sequence parallelism); set "
                             "model.transformer_impl=auto or parallel.sequence_parallel=false")
        return False
    error = te_import_error()
    if error is not None:
        raise ImportError(
            f"model.transformer_impl={impl}: on CUDA the Transformer Engine layer spec is required, but "
            f"transformer_engine.pytorch does not import ({error}). Install the gpu extra and TE's torch "
            "extension (README, GPU clusters), or set model.transformer_impl=local to use Megatron's local "
            "spec without sequence parallelism")
    return True


def check_layout(arch: ModelArch, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
    """Refuse layouts the architecture cannot be split into, naming the numbers."""
    if arch.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {arch.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if arch.num_layers % pp:
        raise ValueError(f"parallel.pp={pp} must divide the model's {arch.num_layers} layers")
    sizes = [("num_heads", arch.num_heads), ("num_kv_heads", arch.num_kv_heads)]
    if not arch.is_moe:  # MoE experts are split over etp instead (mapping.check_ep)
        sizes.append(("intermediate_size", arch.intermediate_size))
    elif arch.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert is split like a dense MLP
        sizes.append(("shared_expert_intermediate_size", arch.shared_expert_intermediate_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"parallel.tp={tp} must divide the model's {name}={value}")
    mapping.check_ep(arch, ep, etp)


def moe_config(arch: ModelArch, *, ep: int = 1, etp: int = 1, aux_loss_coef: float | None = None) -> dict:
    """The MoE fields of the TransformerConfig (empty for dense models).

    ``aux_loss_coef`` overrides the HF config's ``router_aux_loss_coef``; 0 turns the router's
    load-balancing loss off.
    """
    if not arch.is_moe:
        return {}
    coef = arch.router_aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_intermediate_size, moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none", moe_aux_loss_coeff=coef,
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        # routers carry megatron-core's RouterReplay (idle unless actor/routing_replay.py sets an action)
        moe_enable_routing_replay=True,
        # Qwen2-MoE: a shared expert scaled by a sigmoid gate, as HF's shared_expert_gate
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=arch.shared_expert_intermediate_size > 0)


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                       dtype: torch.dtype = torch.float32, on_gpu: bool = False,
                       p2p_batched: bool = True, ep: int = 1, etp: int = 1,
                       aux_loss_coef: float | None = None, recompute: bool = False,
                       spec_activation: bool = False) -> TransformerConfig:
    """The TransformerConfig of ``arch``; fusions that need TE/Apex/CUDA stay off. ``recompute``: keep
    only each layer's input for the backward and recompute the layer there (Megatron's full, uniform
    recomputation, one layer at a time; the same gradients for one more forward). ``spec_activation``:
    the layer spec gives the MLP's activation (``spec_gives_activation``)."""
    check_layout(arch, tp, pp, ep, etp)
    moe = moe_config(arch, ep=ep, etp=etp, aux_loss_coef=aux_loss_coef)
    # every layer of a supported MoE model is a MoE layer: its expert width is the only MLP width
    ffn = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=ffn,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        # packed micro-batches differ in length, so pipeline stages exchange shapes per micro-batch;
        # the MoE dispatcher setting only satisfies a check that applies to MoE models
        use_cpu_initialization=not on_gpu, variable_seq_lengths=True,
        # gloo delivers two batched isend/irecv to the same peer out of order (patches/README.md)
        batch_p2p_comm=p2p_batched,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # the MLP takes its activation from the layer spec where the spec gives one (actor/swiglu.py)
        use_te_activation_func=spec_activation,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute
           else {}),
        **({"moe_token_dispatcher_type": "alltoall"} | moe),
    )


def spec_gives_activation(arch: ModelArch, use_te: bool) -> bool:
    """Whether ``layer_spec`` hands the MLP its activation (``SwiGLU``, lean on memory): dense models on the
    local spec; MoE experts and Transformer Engine keep their own."""
    return not use_te and not arch.is_moe


def layer_spec(arch: ModelArch, use_te: bool) -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    experts = arch.num_experts or None  # SequentialMLP experts: the mapping names one MLP per expert
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=False,
                                                          qk_layernorm=arch.qk_norm)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    if spec_gives_activation(arch, use_te):
        spec.submodules.mlp.submodules.activation_func = SwiGLU
    return spec


def _global_name(name: str, layer_offset: int, tied: bool, experts_offset: int = 0) -> str:
    """Parameter name as in a TP1/PP1/EP1 model: global layer and expert index, tied output = embedding."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return mapping.global_name(name, layer_offset, experts_offset)


def _full_init(name: str, shape: list[int], vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith(("norm.weight", "norm_weight")):  # local spec: *layernorm.weight; TE: *.layer_norm_weight
        return torch.ones(shape)
    full = torch.randn(shape, generator=gen) * 0.02
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full[vocab_size:] = 0.0  # TP padding rows, as a converted checkpoint has them
    return full


@torch.no_grad()
def init_weights(chunks: list[GPTModel], arch: ModelArch, *, seed: int, tp: int, tp_rank: int, pp: int,
                 pp_rank: int, etp: int = 1, etp_rank: int = 0) -> None:
    """Seeded random weights that are the same function at every TP/PP layout.

    Megatron's own CPU initialisation draws from one generator in construction order, so a PP
    stage that skips the embedding, or a larger TP padding of the vocabulary, shifts every later
    draw. Here each parameter's full (unsharded) tensor comes from a generator seeded by its
    layout-independent name, and this rank keeps its TP shard the way Megatron splits it
    (``partition_dim``, ``partition_stride``). Experts are named by their global index and split
    over the expert-TP ranks (``etp``), so the same seed also gives the same model at any EP layout.
    """
    offset = pp_rank * (arch.num_layers // pp)
    for chunk in chunks:
        first_expert = expert_offset(chunk)
        for name, param in chunk.named_parameters():
            gname = _global_name(name, offset, arch.tie_word_embeddings, first_expert)
            # Megatron marks expert weights allreduce=False (their grads reduce over expert DP)
            size, rank = (etp, etp_rank) if getattr(param, "allreduce", True) is False else (tp, tp_rank)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            shape = list(param.shape)
            if dim >= 0:
                shape[dim] *= size
            full = _full_init(gname, shape, arch.vocab_size, seed)
            if dim >= 0:
                stride = getattr(param, "partition_stride", 1)
                pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
                full = torch.cat(pieces[rank::size], dim=dim)
            param.copy_(full.to(param.dtype))


def build_model(arch: ModelArch, groups: ParallelGroups, *, sequence_parallel: bool = False,
                dtype: torch.dtype = torch.float32, seed: int = 1, use_te: bool | None = None,
                transformer_impl: str = "auto", aux_loss_coef: float | None = None,
                recompute: bool = False) -> list[GPTModel]:
    """This rank's GPTModel chunk in the layout of ``groups`` (its pipeline stage, its tensor- and
    expert-parallel shards, on its device), randomly initialised from ``seed``.

    ``groups`` is what ``actor.parallel.init_parallel`` returned: Megatron's parallel state for its
    (tp, pp, ep, etp) is initialised. The same seed gives the same full model at any TP/PP layout
    (``init_weights``). ``use_te`` forces the spec (benchmarks compare both); otherwise
    ``transformer_impl`` decides. ``recompute``: activation recomputation (``transformer_config``).
    """
    tp, pp, pp_rank, ep, etp = groups.tp, groups.pp, groups.pp_rank, groups.ep, groups.etp
    device = groups.device
    on_gpu = device.type == "cuda"
    if use_te is None:
        use_te = use_transformer_engine(transformer_impl, on_gpu=on_gpu, sequence_parallel=sequence_parallel)
    if use_te and not on_gpu:
        raise ValueError("the Transformer Engine spec needs a CUDA device")
    if not use_te:
        packed_rope.install()  # the local spec's packed rotary, one table per micro-batch
    if arch.is_moe:
        ensure_router_gemm_fallback()
    config = transformer_config(arch, tp=tp, pp=pp, sequence_parallel=sequence_parallel, dtype=dtype,
                                on_gpu=on_gpu, p2p_batched=on_gpu, ep=ep, etp=etp, aux_loss_coef=aux_loss_coef,
                                recompute=recompute, spec_activation=spec_gives_activation(arch, use_te))
    torch.manual_seed(seed)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(arch, use_te),
        vocab_size=arch.padded_vocab_size(tp), max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1, parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    model.rotary_pos_emb.inv_freq = rope_inv_freq(arch).to(device)
    init_weights([model], arch, seed=seed, tp=tp, tp_rank=groups.tp_rank, pp=pp, pp_rank=pp_rank, etp=etp,
                 etp_rank=groups.etp_rank)
    model.to(device)
    log.info("built %s stage %d/%d: %.2fM parameters on this rank (%s spec)", arch.model_type, pp_rank, pp,
             sum(p.numel() for p in model.parameters()) / 1e6, "TE" if use_te else "local")
    return [model]
