"""Checks of a plan against the run's configuration: memory, staleness bound, ports, shapes.

Everything here is arithmetic on the plan and the config, so ``--dry-run`` can tell a user before
the job queues for hours that 32B weights plus Adam state do not fit, or that ``eta`` is unset.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from megatron_areal.config import Config
from megatron_areal.launch.context_check import check_context
from megatron_areal.model.arch import ModelArch, UnsupportedModelError, load_arch
from megatron_areal.model.catalogue import resolve_arch
from megatron_areal.model.counts import (
    BF16_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_GRAD_BYTES,
    active_param_count,
    expert_param_count,
    param_count,
    trainer_state_bytes,
)
from megatron_areal.run.plan import Plan

GB = 1e9
# The paper's staleness ablation: AIME24 holds up to eta = 8 with decoupled PPO and drops at 16.
ETA_WARN_ABOVE = 8


def model_arch(cfg: Config) -> ModelArch | None:
    """The architecture when the model path is a local HF folder (built-in names are not resolved:
    that may convert a model, and a dry-run must be instant)."""
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        return None
    try:
        return load_arch(path)
    except (UnsupportedModelError, FileNotFoundError):
        return None


def catalogue_arch(cfg: Config) -> ModelArch | None:
    """The catalogue of published models, so a plan for a model whose weights are not on this
    machine (a laptop planning a cluster run) is still checked."""
    try:
        return resolve_arch(cfg.model.path)[1]
    except (ValueError, OSError, UnsupportedModelError):
        return None


def model_params(cfg: Config, arch: ModelArch | None, known: ModelArch | None) -> float | None:
    """From the local config.json, else cluster.model_params_b, else the catalogue."""
    if arch is not None:
        return float(param_count(arch))
    if cfg.cluster.model_params_b > 0:
        return cfg.cluster.model_params_b * 1e9
    return float(param_count(known)) if known is not None else None


def check_plan(plan: Plan, cfg: Config, eta_explicit: bool, *, model_here: bool = False) -> None:
    """Append failed checks to ``plan.errors`` (and softer findings to ``plan.warnings``).

    ``model_here``: the job starts from this machine's filesystem (planning inside its allocation),
    so ``model.path`` must resolve here; otherwise a model only the catalogue knows is a warning."""
    _check_eta(plan, cfg, eta_explicit)
    _check_ports(plan)
    _check_batch(plan, cfg)
    _check_transformer_impl(plan, cfg)
    arch = model_arch(cfg)
    known = None if arch is not None else catalogue_arch(cfg)
    if not _check_model_path(plan, cfg, arch, known, model_here):
        return  # the sizing checks below would only repeat that the model is unknown
    check_context(plan, cfg)
    if arch is not None or known is not None:
        _check_shapes(plan, arch or known)
    _check_experts(plan, cfg, arch or known)
    if plan.gpus_per_node > 0:
        params = model_params(cfg, arch, known)
        if params is None:
            plan.errors.append(f"cannot size the model: {cfg.model.path} is not a local HF folder nor a "
                               "known model; set cluster.model_params_b")
        else:
            _check_memory(plan, cfg, params, arch or known)


def _check_model_path(plan: Plan, cfg: Config, arch: ModelArch | None, known: ModelArch | None,
                      model_here: bool) -> bool:
    """Whether ``model.path`` resolves (a built-in name or an HF folder here), as the launcher will
    resolve it once for every role; False (with an error) when the job could not start."""
    from megatron_areal.model.assets import BUILTIN_MODELS

    key = cfg.model.path
    path = Path(key).expanduser()
    if key in BUILTIN_MODELS or arch is not None:
        return True
    where = f"'{key}'" if path.is_absolute() else f"'{key}' ({path.absolute()})"
    if path.exists():
        plan.errors.append(f"model.path {where} has no config.json: not a Hugging Face model folder")
        return False
    if not model_here and (known is not None or cfg.cluster.model_params_b > 0):
        plan.warnings.append(f"model.path '{key}' is not a folder on this machine; the job needs it as an HF "
                             "folder where it starts (a relative path resolves against that directory)")
        return True
    plan.errors.append(f"model.path {where} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
                       "Hugging Face folder with a config.json on this machine")
    return False


def _check_transformer_impl(plan: Plan, cfg: Config) -> None:
    """TE is required on GPUs (unless opted out) and impossible on CPUs; Megatron's local spec builds
    torch norms, which refuse sequence parallelism on GPUs (the CPU patch lifts that on gloo only)."""
    impl = cfg.model.transformer_impl
    if plan.gpus_per_node == 0 and impl == "transformer_engine":
        plan.errors.append("model.transformer_impl=transformer_engine needs GPUs; this plan has CPU nodes "
                           "(use auto or local)")
    if plan.gpus_per_node > 0 and impl == "local" and cfg.parallel.sequence_parallel:
        plan.errors.append("parallel.sequence_parallel needs Transformer Engine on GPUs, but "
                           "model.transformer_impl=local selects Megatron's local spec, whose torch norms "
                           "refuse sequence parallelism; set model.transformer_impl=auto or "
                           "parallel.sequence_parallel=false")


def _check_eta(plan: Plan, cfg: Config, explicit: bool) -> None:
    eta = cfg.staleness.eta
    if not explicit:
        plan.errors.append("staleness.eta is not set in the config: choose the staleness bound "
                           "explicitly (0 = synchronous; the paper finds eta <= 4 costs no accuracy "
                           "with decoupled PPO)")
    elif eta > ETA_WARN_ABOVE:
        plan.warnings.append(f"staleness.eta = {eta}: the paper's ablation loses accuracy beyond "
                             f"eta = {ETA_WARN_ABOVE} even with decoupled PPO")


def _check_ports(plan: Plan) -> None:
    used: Counter[tuple[str, int]] = Counter()
    for s in plan.servers:  # each server owns [port, port + stride): SGLang opens ports next to it
        for p in range(s.port, s.port + plan.port_stride):
            used[(s.addr, p)] += 1
    t = plan.trainer
    used[(t.master_addr, t.master_port)] += 1
    clashes = sorted(f"{addr}:{port}" for (addr, port), n in used.items() if n > 1)
    if clashes:
        plan.errors.append(f"ports collide on {', '.join(clashes[:5])}")
    top = max((p for _, p in used), default=0)
    if top > 65535:
        plan.errors.append(f"ports run past 65535 (highest {top}): lower server.base_port")


def _check_batch(plan: Plan, cfg: Config) -> None:
    seqs = cfg.rollout.batch_size * cfg.rollout.group_size
    if plan.trainer.dp > seqs:
        plan.errors.append(f"trainer data-parallel size {plan.trainer.dp} exceeds the sequences of one "
                           f"step (rollout.batch_size * group_size = {seqs}): ranks would idle")


def _check_shapes(plan: Plan, arch: ModelArch) -> None:
    t = plan.trainer
    if arch.num_layers % t.pp:
        plan.errors.append(f"{arch.num_layers} layers are not divisible by parallel.pp ({t.pp})")
    for name, tp in (("parallel.tp", t.tp), ("server.tp", plan.server_tp)):
        if arch.num_heads % tp or arch.num_kv_heads % tp and tp % arch.num_kv_heads:
            plan.errors.append(f"{arch.num_heads} attention heads / {arch.num_kv_heads} KV heads "
                               f"cannot be split by {name} = {tp}")
    if arch.is_moe and arch.moe_intermediate_size % plan.server_tp:
        plan.errors.append(f"server.tp ({plan.server_tp}) does not divide the experts' width "
                           f"(moe_intermediate_size {arch.moe_intermediate_size}) the server shards")


def _check_experts(plan: Plan, cfg: Config, arch: ModelArch | None) -> None:
    """Expert parallelism: EP ranks come out of data parallel and each holds the same number of whole
    experts; Megatron lays the experts out over ETP x EP x expert-DP x PP = all trainer ranks."""
    ep, etp, t = cfg.parallel.ep, cfg.parallel.etp, plan.trainer
    if ep == 1 and etp == 1:
        return
    failed = len(plan.errors)
    if arch is not None and not arch.is_moe:
        plan.errors.append(f"parallel.ep ({ep}) / parallel.etp ({etp}) apply to Mixture-of-Experts models; "
                           f"{cfg.model.path} is dense (set both to 1)")
        return
    if arch is not None and arch.num_experts % ep:
        plan.errors.append(f"parallel.ep ({ep}) does not divide the model's {arch.num_experts} experts "
                           "(num_experts): every EP rank must hold the same number of whole experts")
    if arch is not None and arch.moe_intermediate_size % etp:
        plan.errors.append(f"parallel.etp ({etp}) does not divide the experts' width "
                           f"(moe_intermediate_size {arch.moe_intermediate_size})")
    if t.dp % ep:
        plan.errors.append(f"parallel.ep ({ep}) does not divide the trainer's data-parallel size ({t.dp}): "
                           "expert parallelism is laid out within data parallel")
    unit = etp * ep * t.pp
    if t.world_size % unit:
        plan.errors.append(f"trainer GPUs ({t.world_size}) are not divisible by parallel.etp * parallel.ep * "
                           f"parallel.pp ({etp} * {ep} * {t.pp} = {unit})")
    if arch is not None and len(plan.errors) == failed:
        plan.notes.append(f"trainer experts: EP {ep} x ETP {etp} x PP {t.pp}, expert DP {t.world_size // unit}; "
                          f"{arch.num_experts // ep} of {arch.num_experts} experts per EP rank")


def _check_memory(plan: Plan, cfg: Config, params: float, arch: ModelArch | None = None) -> None:
    t, cap = plan.trainer, cfg.cluster.gpu_memory_gb * GB
    opt_shards = max(t.dp, 1) if cfg.optimizer.distributed else 1
    if arch is not None and arch.is_moe:
        ep, etp = cfg.parallel.ep, cfg.parallel.etp
        per_gpu = trainer_state_bytes(arch, tp=t.tp, pp=t.pp, dp=max(t.dp, 1), ep=ep, etp=etp,
                                      distributed_optimizer=cfg.optimizer.distributed)
        experts = expert_param_count(arch)
        shared, active = param_count(arch) - experts, active_param_count(arch)
        plan.notes.append(
            f"trainer model state per GPU: {shared / 1e9:.2f}B non-expert params over TP {t.tp} x PP {t.pp} "
            f"and {experts / 1e9:.2f}B expert params over ETP {etp} x EP {ep} x PP {t.pp} "
            f"({active / 1e9:.2f}B active per token) = {per_gpu / GB:.1f} GB of {cap / GB:.0f} GB")
    else:
        per_gpu = params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / opt_shards) / (t.tp * t.pp)
        plan.notes.append(
            f"trainer model state per GPU: {params / 1e9:.2f}B params x ({WEIGHT_GRAD_BYTES} + "
            f"{OPTIMIZER_BYTES}/{opt_shards}) B / (TP {t.tp} x PP {t.pp}) = {per_gpu / GB:.1f} GB "
            f"of {cap / GB:.0f} GB")
    if per_gpu > cap:
        more = "parallel.tp/pp" + ("/ep" if arch is not None and arch.is_moe else "")
        plan.errors.append(f"model too large for the trainer: {per_gpu / GB:.1f} GB of weights, gradients "
                           f"and Adam state per GPU > {cap / GB:.0f} GB; raise {more}")
    elif per_gpu > 0.7 * cap:
        plan.warnings.append(f"trainer model state takes {per_gpu / cap:.0%} of GPU memory; little is "
                             "left for activations")
    budget = cap * cfg.server.mem_fraction
    weights = params * BF16_BYTES / plan.server_tp
    plan.notes.append(f"server weights per GPU: {weights / GB:.1f} GB of {budget / GB:.0f} GB "
                      f"(server.mem_fraction {cfg.server.mem_fraction}); the rest is KV cache")
    if weights > budget:
        plan.errors.append(f"model too large for a server: {weights / GB:.1f} GB of bf16 weights per GPU "
                           f"> {budget / GB:.0f} GB; raise server.tp")
    elif weights > 0.6 * budget:
        plan.warnings.append("server weights leave under 40% of the static memory for KV cache; "
                             "consider a larger server.tp")
