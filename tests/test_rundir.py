"""The run directory has one map (megatron_areal/rundir/layout.py): its layout, and no path built by hand elsewhere."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_areal.config import load_config
from megatron_areal.rundir import layout as rundir
from megatron_areal.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_areal"
FILES = ("plan.json", "metrics.jsonl", "eval.jsonl", "trained.jsonl", "timeline.json", "timeline_summary.json")
FOLDERS = ("servers", "logs", "control", "checkpoints", "tensorboard")
ENTRIES = [name for name, v in vars(RunDir).items() if isinstance(v, property)]


def test_layout() -> None:
    run = RunDir("runs/x")
    assert run.root == Path("runs/x")
    assert {name: getattr(run, name) for name in ENTRIES} == {
        "plan": Path("runs/x/plan.json"), "servers": Path("runs/x/servers"), "logs": Path("runs/x/logs"),
        "control": Path("runs/x/control"), "checkpoints": Path("runs/x/checkpoints"),
        "metrics": Path("runs/x/metrics.jsonl"), "evals": Path("runs/x/eval.jsonl"),
        "trained": Path("runs/x/trained.jsonl"), "tensorboard": Path("runs/x/tensorboard"),
        "timeline": Path("runs/x/timeline.json"), "timeline_summary": Path("runs/x/timeline_summary.json")}
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.root = Path("elsewhere")  # type: ignore[misc]


def test_from_config_honours_checkpoint_dir(tmp_path: Path) -> None:
    cfg = load_config(None, [f"train.run_dir={tmp_path / 'run'}"])
    assert RunDir.of(cfg).checkpoints == tmp_path / "run" / "checkpoints"
    cfg = load_config(None, [f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    run = RunDir.of(cfg)
    assert run.checkpoints == tmp_path / "ck"
    assert run.metrics == tmp_path / "run" / "metrics.jsonl"


def test_resolved_is_absolute_and_the_same_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = RunDir("runs/x").resolved()
    assert run.root.is_absolute() and run.root == tmp_path / "runs" / "x"
    assert run.servers == tmp_path / "runs" / "x" / "servers"


def test_docstring_lists_every_entry() -> None:
    for name in ENTRIES:
        assert f"RunDir.{name}" in rundir.__doc__, name


def test_slurm_scripts_and_readme_name_only_run_dir_entries() -> None:
    """The Slurm scripts spell the layout in bash comments; they must agree with RunDir."""
    known = {getattr(RunDir("RUN_DIR"), name).name for name in ENTRIES}
    for path in [*sorted((ROOT / "slurm").glob("*.sh")), ROOT / "README.md"]:
        for entry in re.findall(r"RUN_DIR/(\w+(?:\.\w+)?)", path.read_text()):
            assert entry in known, f"{path.name}: RUN_DIR/{entry} is not a RunDir entry"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of string constants that stand alone as statements (docstrings): those may name files."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def hand_built_paths(source: str) -> list[str]:
    """Run-directory names spelled in code: a file name in any string, or a folder name joined onto
    a path (``x / "logs"``, ``f"{x}/logs"``, ``os.path.join(x, "logs")``, ``x.joinpath("logs")``)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            found += [f for f in FILES if f in text]
            found += [d for d in FOLDERS if re.search(rf"(^|/){d}(/|$)", text) and "/" in text]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            found += [d for d in FOLDERS if node.right.value == d]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("join",
                                                                                                    "joinpath"):
            found += [d for a in node.args if isinstance(a, ast.Constant) for d in FOLDERS if a.value == d]
    return found


@pytest.mark.parametrize("code", [
    'p = run_dir / "metrics.jsonl"', 'p = Path(run_dir) / "logs"', 'p = f"{run_dir}/servers"',
    'p = os.path.join(run_dir, "control")', 'p = Path(d).joinpath("tensorboard")', 'p = "runs/x/checkpoints"',
    'name = "eval.jsonl"'])
def test_checker_catches_a_hand_built_path(code: str) -> None:
    assert hand_built_paths(code)


def test_checker_lets_docstrings_and_other_words_be() -> None:
    source = ('"""Writes RUN_DIR/metrics.jsonl and RUN_DIR/logs/."""\n'
              'def f(d):\n    """Reads d/plan.json."""\n    return d["servers"], "rollout/servers_dropped"\n')
    assert hand_built_paths(source) == []


def test_no_module_outside_rundir_builds_run_paths() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "rundir" / "layout.py":
            continue
        found = hand_built_paths(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}, f"use megatron_areal.rundir.layout.RunDir instead: {offenders}"
