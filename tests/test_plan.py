"""The launch planner against the Slurm scripts: roles, ports, documented layouts, dry-run errors."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from megatron_areal.config import load_config
from megatron_areal.launch.cli import main as train_main
from megatron_areal.launch.slurm import expand_hostlist, plan_allocation
from megatron_areal.run.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"1.5b": 16, "7b": 24, "32b": 64, "qwen3_30b_a3b": 16}  # script -> the node count it documents
SIZES = (16, 24, 64)


def slurm_env(nodes: int, gpus: int = 8) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST": f"gpu[{1:03d}-{nodes:03d}]", "SLURM_GPUS_PER_NODE": str(gpus),
            "SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "96"}


def plan_for(script: str, nodes: int, overrides: list[str] | None = None) -> Plan:
    cfg = load_config(ROOT / f"configs/train_{script}.yaml", overrides or [])
    return plan_allocation(cfg, eta_explicit=True, env=slurm_env(nodes))


def doc_layout(script: str) -> dict[str, int]:
    """The numbers of the script's '== layout ==' block."""
    text = (ROOT / f"slurm/train_{script}.sh").read_text()
    block = text.split("== layout", 1)[1].split("# ==", 1)[0]
    patterns = {
        "nodes": r"nodes:\s+(\d+) x (\d+) GPUs",
        "rollout": r"rollout:\s+(\d+) nodes, (\d+) GPUs, (\d+) servers x TP (\d+)",
        "trainer": r"trainer:\s+(\d+) nodes, (\d+) GPUs, TP (\d+) x PP (\d+) x DP (\d+)",
        "eta": r"eta:\s+(\d+)",
    }
    out: dict[str, int] = {}
    for key, pattern in patterns.items():
        m = re.search(pattern, block)
        assert m, f"slurm/train_{script}.sh: layout line '{key}' missing or malformed"
        for i, v in enumerate(m.groups()):
            out[f"{key}{i}"] = int(v)
    sbatch_nodes = re.search(r"#SBATCH --nodes=(\d+)", text)
    out["sbatch_nodes"] = int(sbatch_nodes.group(1))
    return out


def gpu_roles(plan: Plan) -> Counter[tuple[str, int]]:
    roles: Counter[tuple[str, int]] = Counter()
    for node in plan.trainer.nodes:
        for g in plan.trainer.gpus:
            roles[(node, g)] += 1
    for s in plan.servers:
        for g in s.gpus:
            roles[(s.node, g)] += 1
    return roles


@pytest.mark.parametrize("nodes", SIZES)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_gpu_has_one_role_and_ports_are_distinct(script: str, nodes: int) -> None:
    plan = plan_for(script, nodes)
    assert plan.ok, plan.errors
    roles = gpu_roles(plan)
    every_gpu = {(f"gpu{n:03d}", g) for n in range(1, nodes + 1) for g in range(8)}
    assert set(roles) == every_gpu
    assert set(roles.values()) == {1}
    assert {plan.role_of(n.name) for n in plan.nodes} == {"trainer", "rollout"}
    # each server owns [port, port + stride); nothing on one address overlaps
    for addr in {n.addr for n in plan.nodes}:
        ranges = [range(s.port, s.port + plan.port_stride) for s in plan.servers if s.addr == addr]
        if plan.trainer.master_addr == addr:
            ranges.append(range(plan.trainer.master_port, plan.trainer.master_port + 1))
        ports = [p for r in ranges for p in r]
        assert len(ports) == len(set(ports)), f"ports collide on {addr}"
    assert len({s.id for s in plan.servers}) == len(plan.servers)
    assert plan.trainer.master_addr == plan.nodes[0].addr == f"gpu{1:03d}"  # rendezvous: first trainer node


@pytest.mark.parametrize("script", SCRIPTS)
def test_layout_matches_the_script_documentation(script: str) -> None:
    doc = doc_layout(script)
    nodes = SCRIPTS[script]
    assert doc["sbatch_nodes"] == doc["nodes0"] == nodes
    plan = plan_for(script, nodes)
    t = plan.trainer
    rollout_nodes = plan.nodes_with_role("rollout")
    assert (doc["nodes0"], doc["nodes1"]) == (len(plan.nodes), plan.gpus_per_node)
    assert (doc["rollout0"], doc["rollout1"], doc["rollout2"], doc["rollout3"]) == (
        len(rollout_nodes), len(rollout_nodes) * plan.gpus_per_node, len(plan.servers), plan.server_tp)
    assert (doc["trainer0"], doc["trainer1"], doc["trainer2"], doc["trainer3"], doc["trainer4"]) == (
        len(t.nodes), t.world_size, t.tp, t.pp, t.dp)
    cfg = load_config(ROOT / f"configs/train_{script}.yaml")
    assert doc["eta0"] == cfg.staleness.eta
    assert cfg.cluster.nodes == nodes
    experts = re.search(r"# experts:\s+EP (\d+) x ETP (\d+)", (ROOT / f"slurm/train_{script}.sh").read_text())
    documented = (int(experts[1]), int(experts[2])) if experts else (1, 1)
    assert documented == (cfg.parallel.ep, cfg.parallel.etp)


def test_tiny_script_layout_on_two_cpu_nodes() -> None:
    doc = doc_layout("tiny")
    cfg = load_config(ROOT / "configs/train_tiny.yaml")
    plan = plan_allocation(cfg, eta_explicit=True, env={"SLURM_JOB_NODELIST": "n[1-2]"})
    assert plan.ok, plan.errors
    assert plan.gpus_per_node == 0 and len(plan.nodes) == doc["sbatch_nodes"] == doc["nodes0"] == 2
    assert [plan.role_of(n) for n in ("n1", "n2")] == ["trainer", "rollout"]
    assert len(plan.servers) == doc["rollout2"] == cfg.server.count
    assert (plan.trainer.tp, plan.trainer.pp, plan.trainer.dp) == (doc["trainer2"], doc["trainer3"], doc["trainer4"])
    assert len({(s.addr, s.port) for s in plan.servers} | {(plan.trainer.master_addr, plan.trainer.master_port)}) == 3


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = plan_for("32b", 64)
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == plan
    with pytest.raises(FileNotFoundError, match="shared by all nodes"):
        Plan.load(tmp_path / "missing" / "plan.json")


def test_hostlist_expansion_matches_scontrol() -> None:
    expr = "gpu[001-003,010],login7,n[8-11]"
    names = expand_hostlist(expr)
    assert names == ["gpu001", "gpu002", "gpu003", "gpu010", "login7", "n8", "n9", "n10", "n11"]
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True, text=True, check=True)
        assert out.stdout.split() == names


def _dry(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = train_main(args)
    return rc, capsys.readouterr().out


def test_dry_run_512_gpus_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / "configs/train_32b.yaml"), "--dry-run", "--nodes", "64", "--gpus-per-node", "8"], capsys)
    assert rc == 0, out
    assert "64 nodes x 8 GPUs = 512 GPUs" in out
    assert "TP 8 x PP 2 x DP 8" in out and "96 sglang servers x TP 4" in out
    assert "checks: all passed" in out


@pytest.mark.parametrize("extra, expected", [
    (["--nodes", "5", "parallel.tp=3"], "not divisible by parallel.tp * parallel.pp"),
    (["--nodes", "4", "--gpus-per-node", "6"], "GPUs per node (6) are not divisible by server.tp (4)"),
    (["--nodes", "4", "parallel.tp=2", "parallel.pp=1"], "model too large for the trainer"),
    (["--nodes", "16", "server.tp=1", "cluster.gpu_memory_gb=64"], "model too large for a server"),
    (["--nodes", "4", "--gpus-per-node", "4", "parallel.tp=8"], "tensor parallelism across nodes"),
    (["--nodes", "16", "rollout.batch_size=1", "rollout.group_size=1"], "exceeds the sequences of one step"),
    (["--nodes", "16", "model.path=/nowhere/unknown-model"], "model.path '/nowhere/unknown-model' is neither"),
    (["--nodes", "16", "parallel.pp=3"], "64 layers are not divisible by parallel.pp (3)"),
    (["--nodes", "16", "model.path=deepseek-r1-distill-qwen-7b"], "28 attention heads / 4 KV heads cannot be split"),
])
def test_dry_run_reports_failing_checks(extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / "configs/train_32b.yaml"), "--dry-run", *extra], capsys)
    assert rc == 1
    assert "FAILED" in out and expected in out


# ---- Mixture-of-Experts plans: Qwen3-30B-A3B (slurm/train_qwen3_30b_a3b.sh) and the Qwen3-235B-A22B plan


@pytest.mark.parametrize("config, nodes, layout, experts", [
    ("train_qwen3_30b_a3b", 16, "TP 2 x PP 1 x DP 16", "EP 8 x ETP 1 x PP 1, expert DP 4; 16 of 128 experts"),
    ("train_qwen3_235b_a22b", 64, "TP 4 x PP 2 x DP 16", "EP 16 x ETP 1 x PP 2, expert DP 4; 8 of 128 experts"),
])
def test_dry_run_moe_plans_pass(config: str, nodes: int, layout: str, experts: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / f"configs/{config}.yaml"), "--dry-run", "--nodes", str(nodes), "--gpus-per-node", "8"],
                   capsys)
    assert rc == 0, out
    assert f"{nodes} nodes x 8 GPUs = {nodes * 8} GPUs" in out and layout in out and "checks: all passed" in out
    assert f"note: trainer experts: {experts} per EP rank" in out
    assert "warning: model.path 'Qwen/Qwen3-" in out and "is not a folder on this machine" in out


def _moe_state_gb(out: str) -> float:
    m = re.search(r"note: trainer model state per GPU: .* = ([\d.]+) GB of", out)
    assert m, out
    return float(m[1])


def test_expert_parallelism_splits_the_trainer_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """Smaller EP holds more experts per GPU; 30B of experts on one EP rank do not fit 80 GB."""
    base = [str(ROOT / "configs/train_qwen3_30b_a3b.yaml"), "--dry-run", "--nodes", "16", "--gpus-per-node", "8"]
    state = {}
    for ep in (8, 4, 2):
        rc, out = _dry([*base, f"parallel.ep={ep}"], capsys)
        state[ep] = _moe_state_gb(out)
    assert state[2] > state[4] > state[8]
    # 1.54B non-expert parameters over TP 2 with Adam over DP 16, 28.99B expert parameters over EP 8
    # with Adam over the 4 expert data-parallel ranks: 0.77 * (6 + 12/16) + 3.62 * (6 + 12/4) GB
    assert state[8] == pytest.approx(1.5425 / 2 * (6 + 12 / 16) + 28.991 / 8 * (6 + 12 / 4), abs=0.1)
    rc, out = _dry([*base, "parallel.ep=1", "parallel.etp=1"], capsys)
    assert rc == 1 and "FAILED: model too large for the trainer" in out and "raise parallel.tp/pp/ep" in out


@pytest.mark.parametrize("extra, expected", [
    (["parallel.ep=3"], "parallel.ep (3) does not divide the model's 128 experts (num_experts)"),
    (["parallel.ep=32"], "parallel.ep (32) does not divide the trainer's data-parallel size (16)"),
    (["parallel.etp=3"], "trainer GPUs (32) are not divisible by parallel.etp * parallel.ep * parallel.pp "
                         "(3 * 8 * 1 = 24)"),
    (["parallel.etp=5"], "parallel.etp (5) does not divide the experts' width (moe_intermediate_size 768)"),
    (["model.path=deepseek-r1-distill-qwen-7b"], "parallel.ep (8) / parallel.etp (1) apply to Mixture-of-Experts "
                                                 "models; deepseek-r1-distill-qwen-7b is dense"),
])
def test_dry_run_refuses_bad_expert_parallelism(extra: list[str], expected: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / "configs/train_qwen3_30b_a3b.yaml"), "--dry-run", "--nodes", "16",
                    "--gpus-per-node", "8", *extra], capsys)
    assert rc == 1, out
    assert f"FAILED: {expected}" in out, out


def test_dry_run_eta_missing_and_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "configs/train_7b.yaml").read_text()
    no_eta = tmp_path / "no_eta.yaml"
    no_eta.write_text(re.sub(r"staleness:\n\s+eta: \d+.*\n", "", text))
    rc, out = _dry([str(no_eta), "--dry-run"], capsys)
    assert rc == 1 and "staleness.eta is not set" in out
    rc, out = _dry([str(no_eta), "--dry-run", "staleness.eta=2"], capsys)
    assert rc == 0, out
    rc, out = _dry([str(no_eta), "--dry-run", "staleness.eta=-1"], capsys)
    assert rc == 2 and "staleness.eta: must be >= 0" in out
    rc, out = _dry([str(no_eta), "--dry-run", "staleness.eta=16"], capsys)
    assert rc == 0 and "warning: staleness.eta = 16" in out


def test_cpu_roles_get_their_thread_count_and_gpu_roles_do_not():
    from megatron_areal.launch.commands import role_env

    assert role_env((), False, threads=3)["OMP_NUM_THREADS"] == "3"
    env = role_env((0,), False, threads=3)
    assert env.get("OMP_NUM_THREADS") != "3" and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_cpu_roles_sleep_at_openmp_barriers_unless_the_user_says_otherwise(monkeypatch):
    from megatron_areal.launch.commands import role_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert role_env((), False, threads=2)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert role_env((), False, threads=2)["OMP_WAIT_POLICY"] == "ACTIVE"


def _one_cpu_node(overrides: list[str]):
    """The main job's config with ``overrides``, and its plan on one CPU node ``n0``."""
    from megatron_areal.run.plan import Node, make_plan

    cfg = load_config(ROOT / "configs/smollm2_arith.yaml", overrides)
    return cfg, make_plan([Node("n0", "127.0.0.1")], 0, cfg.cluster, cfg.server, 1, 1)


def test_cpu_roles_with_cores_of_their_own_keep_openmps_spinning(monkeypatch):
    """Sleeping at every barrier costs a decode step hundreds of wake-ups: only roles that share cores sleep."""
    from megatron_areal.launch.commands import role_env, shares_cores

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "OMP_WAIT_POLICY" not in role_env((), False, threads=2, shares_cores=False)
    cfg, plan = _one_cpu_node(["server.count=2", "server.threads=1", "cluster.cpu_threads=1"])
    assert plan.cpu_threads_on("n0", server_threads=1, trainer_threads=1) == 3
    assert plan.cpu_threads_on("n0", server_threads=2, trainer_threads=3) == 7
    monkeypatch.setattr("megatron_areal.launch.commands.usable_cores", lambda: 2)
    assert shares_cores(plan, "n0", cfg)
    monkeypatch.setattr("megatron_areal.launch.commands.usable_cores", lambda: 3)
    assert not shares_cores(plan, "n0", cfg)


def test_synchronous_roles_take_turns_on_the_cores_and_keep_openmps_spinning(monkeypatch):
    """A synchronous run (``staleness.overlap: false``) generates, then trains: its servers and its trainer
    never compute at the same time, so two threads each on two cores do not share them. Sleeping at every
    barrier made such a run's 2-thread server decode 2.5x slower than 1 thread (bench/async_vs_sync.py)."""
    from megatron_areal.launch.commands import shares_cores

    monkeypatch.setattr("megatron_areal.launch.commands.usable_cores", lambda: 2)
    for overlap, eta, shared in ((True, 4, True), (False, 0, False)):
        cfg, plan = _one_cpu_node(["server.count=1", "server.threads=2", "cluster.cpu_threads=2",
                                   f"staleness.overlap={str(overlap).lower()}", f"staleness.eta={eta}"])
        assert shares_cores(plan, "n0", cfg) is shared, (overlap, eta)
    # Servers still generate together: two 2-thread servers share two cores, synchronous or not.
    cfg, plan = _one_cpu_node(["server.count=2", "server.threads=2", "cluster.cpu_threads=1",
                               "staleness.overlap=false", "staleness.eta=0"])
    assert shares_cores(plan, "n0", cfg)


# ---- Transformer Engine: required on GPUs unless the config opts out; sequence parallelism needs it


def test_sequence_parallel_without_transformer_engine_is_refused_on_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's local spec builds torch norms, which assert on sequence parallelism (torch_norm.py)."""
    base = [str(ROOT / "configs/train_32b.yaml"), "--dry-run", "--nodes", "64", "--gpus-per-node", "8"]
    rc, out = _dry([*base, "model.transformer_impl=local"], capsys)
    assert rc == 1, out
    assert "FAILED: parallel.sequence_parallel needs Transformer Engine" in out and "model.transformer_impl" in out
    rc, out = _dry([*base, "model.transformer_impl=local", "parallel.sequence_parallel=false"], capsys)
    assert rc == 0, out


def test_transformer_engine_is_refused_on_cpu_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / "configs/train_tiny.yaml"), "--dry-run", "model.transformer_impl=transformer_engine"],
                   capsys)
    assert rc == 1 and "FAILED: model.transformer_impl=transformer_engine needs GPUs" in out, out


def test_spec_choice_requires_transformer_engine_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a failed TE import is an error naming the import failure, not a silent local spec."""
    import sys

    from megatron_areal.actor.model import use_transformer_engine

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails as when TE is absent
    with pytest.raises(ImportError, match=r"model.transformer_impl.*transformer_engine.pytorch.*(import|halted)"):
        use_transformer_engine("auto", on_gpu=True)
    with pytest.raises(ImportError, match="model.transformer_impl"):
        use_transformer_engine("transformer_engine", on_gpu=True)
    assert use_transformer_engine("local", on_gpu=True) is False  # the explicit opt-out
    assert use_transformer_engine("auto", on_gpu=False) is False  # CPU: the local spec, as always
    with pytest.raises(ValueError, match="needs a CUDA device"):
        use_transformer_engine("transformer_engine", on_gpu=False)
    with pytest.raises(ValueError, match="sequence_parallel"):
        use_transformer_engine("local", on_gpu=True, sequence_parallel=True)


# ---- the model path: resolved once for every role, and checked by the plan


def test_unresolvable_model_path_fails_a_cpu_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CPU plans never sized the model, so a typo in model.path passed every check."""
    config = str(ROOT / "configs/train_tiny.yaml")
    rc, out = _dry([config, "--dry-run", f"model.path={tmp_path}/no-such-model"], capsys)
    assert rc == 1 and f"FAILED: model.path '{tmp_path}/no-such-model' is neither" in out, out
    (tmp_path / "empty").mkdir()
    rc, out = _dry([config, "--dry-run", f"model.path={tmp_path}/empty"], capsys)
    assert rc == 1 and "has no config.json" in out, out
    rc, out = _dry([config, "--dry-run", "model.path=tiny-qwen2"], capsys)  # built-in: prepared on first use
    assert rc == 0, out


def test_known_model_missing_here_warns_when_planning_for_another_cluster(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _dry([str(ROOT / "configs/train_32b.yaml"), "--dry-run", "--nodes", "64", "--gpus-per-node", "8"], capsys)
    assert rc == 0, out
    assert "warning: model.path 'deepseek-ai/DeepSeek-R1-Distill-Qwen-32B' is not a folder on this machine" in out


def test_model_path_must_exist_when_planning_inside_the_allocation(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in slurm_env(64).items():
        monkeypatch.setenv(key, value)
    rc, out = _dry([str(ROOT / "configs/train_32b.yaml"), "--dry-run"], capsys)
    assert rc == 1, out
    assert f"FAILED: model.path 'deepseek-ai/DeepSeek-R1-Distill-Qwen-32B' ({Path.cwd()}/deepseek-ai/" in out
    assert "is neither a built-in model" in out


def test_model_path_is_resolved_once_to_an_absolute_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang reads a relative path that is not a folder in its own directory as a hub id; every role gets
    the absolute folder the launcher resolved."""
    from megatron_areal.launch.commands import resolved_model_path, server_command
    from megatron_areal.model.assets import make_tiny_model

    make_tiny_model(tmp_path / "models" / "tiny", num_layers=2)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs/train_32b.yaml", ["model.path=models/tiny"])
    model_dir = resolved_model_path(cfg)
    assert model_dir == str(tmp_path / "models" / "tiny")
    plan = plan_for("32b", 64)
    cmd = server_command(plan.servers[0], cfg, model_dir, tmp_path / "servers")
    assert cmd[cmd.index("--model-path") + 1] == model_dir
    cfg = load_config(ROOT / "configs/train_32b.yaml", ["model.path=models/missing"])
    with pytest.raises(FileNotFoundError, match="models/missing"):
        resolved_model_path(cfg)


# ---- the weight-update groups' master address: each trainer node's address from the plan


def _master_address_overrides(cmd: list[str]) -> list[str]:
    return [a for a in cmd if a.startswith("weights.master_address=")]


def test_each_trainer_node_hosts_its_weight_groups_at_its_plan_address(tmp_path: Path) -> None:
    """Stage heads host the groups' stores; with PP 2 on 16 trainer nodes, stage 1's head is on the 9th."""
    from megatron_areal.launch.commands import trainer_command

    plan = plan_for("32b", 64)
    config = str(ROOT / "configs/train_32b.yaml")
    for rank, node in enumerate(plan.trainer.nodes):
        cmd = trainer_command(plan, rank, config, [], tmp_path / "plan.json")
        assert _master_address_overrides(cmd) == [f"weights.master_address={plan.node(node).addr}"]
    cmd = trainer_command(plan, 8, config, ["weights.master_address=10.0.0.9"], tmp_path / "plan.json")
    assert _master_address_overrides(cmd)[-1] == "weights.master_address=10.0.0.9"  # the user's word is last
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text((ROOT / "configs/train_32b.yaml").read_text() + "weights:\n  master_address: 10.1.2.3\n")
    assert _master_address_overrides(trainer_command(plan, 0, str(explicit), [], tmp_path / "plan.json")) == []


def test_local_trainer_hosts_its_weight_groups_at_the_server_host(tmp_path: Path) -> None:
    from megatron_areal.launch.commands import trainer_command
    from megatron_areal.launch.local import local_plan

    cfg = load_config(ROOT / "configs/train_tiny.yaml", ["server.host=127.0.0.1"])
    plan = local_plan(cfg)
    cmd = trainer_command(plan, 0, str(ROOT / "configs/train_tiny.yaml"), [], tmp_path / "plan.json")
    assert _master_address_overrides(cmd) == ["weights.master_address=127.0.0.1"]
