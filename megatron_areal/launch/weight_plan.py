"""The weight push's transfer plan for a launch plan, as ``--dry-run`` prints it (``weights/plan.py``)."""
from __future__ import annotations

from megatron_areal.config import Config
from megatron_areal.launch.checks import catalogue_arch, model_arch
from megatron_areal.run.plan import Plan
from megatron_areal.weights.plan import ServerLayout, TrainerLayout, make_plan, stage_head_share


def describe_weight_push(cfg: Config, plan: Plan) -> str:
    """A few lines: bytes per push, the busiest trainer rank's share and, for SGLang, the stage-head path."""
    arch = model_arch(cfg) or catalogue_arch(cfg)
    if arch is None:
        return "weight push plan: the model's architecture is not known here (not a local folder or a catalogued name)"
    t = plan.trainer
    try:  # a layout the checks refuse has no plan; their messages say why
        trainer = TrainerLayout(t.tp, t.pp, t.dp, cfg.parallel.ep, cfg.parallel.etp)
        push = make_plan(arch, trainer, ServerLayout(len(plan.servers), plan.server_tp, sharded=True),
                         dtype_bytes=2 if cfg.model.dtype in ("bfloat16", "float16") else 4)
    except ValueError as e:
        return f"weight push plan: {e}"
    text = push.summary()
    if plan.engine == "sglang":  # SGLang takes whole tensors from one source per group: the stage heads send
        text += (f"\n  SGLang: each stage's head sends its stage (busiest share {stage_head_share(trainer):.2f}), "
                 "all stages at once over their own groups")
    return text
