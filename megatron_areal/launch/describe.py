"""Human-readable text of a launch plan (what ``megatron-areal train CONFIG --dry-run`` prints)."""
from __future__ import annotations

from megatron_areal.run.plan import Plan


def _gpu_range(gpus: tuple[int, ...]) -> str:
    return f"{gpus[0]}" if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}"


def _node_line(plan: Plan, name: str) -> str:
    role = plan.role_of(name)
    parts = []
    t = plan.trainer
    if name in t.nodes:
        where = f", rendezvous {t.master_addr}:{t.master_port}" if t.nodes.index(name) == 0 else ""
        devices = f"on GPUs {_gpu_range(t.gpus)}" if t.gpus else "on CPU"
        parts.append(f"torchrun, {t.nproc_per_node} ranks {devices}{where}")
    servers = plan.servers_on(name)
    if servers:
        ports = [s.port for s in servers]
        span = f"{ports[0]}" if len(ports) == 1 else f"{ports[0]}..{ports[-1]} step {plan.port_stride}"
        gpus = "" if not servers[0].gpus else f" on GPUs {_gpu_range(servers[0].gpus)}..{_gpu_range(servers[-1].gpus)}"
        parts.append(f"{len(servers)} servers{gpus}, ports {span}")
    return f"  {name:<12} {role:<8} " + "; ".join(parts)


def _grouped_node_lines(plan: Plan) -> list[str]:
    """One line per node, but runs of nodes with identical duties collapse into one line."""
    lines: list[str] = []
    run: list[str] = []
    key_of = {n.name: _node_line(plan, n.name).split(None, 1)[1] for n in plan.nodes}
    for node in plan.nodes:
        if run and key_of[node.name] != key_of[run[0]]:
            lines.append(_run_line(run, key_of))
            run = []
        run.append(node.name)
    if run:
        lines.append(_run_line(run, key_of))
    return lines


def _run_line(run: list[str], key_of: dict[str, str]) -> str:
    label = run[0] if len(run) == 1 else f"{run[0]}..{run[-1]} ({len(run)})"
    return f"  {label:<22} {key_of[run[0]]}"


def describe(plan: Plan, title: str) -> str:
    t = plan.trainer
    gpn = plan.gpus_per_node
    total = f"{len(plan.nodes)} nodes x {gpn} GPUs = {len(plan.nodes) * gpn} GPUs" if gpn else \
        f"{len(plan.nodes)} CPU nodes"
    rollout_nodes = [n.name for n in plan.nodes if plan.role_of(n.name) in ("rollout", "both")]
    lines = [
        f"plan for {title}: {total}",
        f"trainer: {len(t.nodes)} node(s), {t.world_size} ranks: TP {t.tp} x PP {t.pp} x DP {t.dp}; "
        f"rendezvous {t.master_addr}:{t.master_port}; torchrun node ranks follow the node order",
        f"rollout: {len(rollout_nodes)} node(s), {len(plan.servers)} {plan.engine} servers x TP {plan.server_tp}",
        "nodes:",
        *_grouped_node_lines(plan),
    ]
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.errors:
        lines.append(f"checks: {len(plan.errors)} FAILED")
        lines += [f"  FAILED: {e}" for e in plan.errors]
    else:
        lines.append("checks: all passed")
    return "\n".join(lines)
