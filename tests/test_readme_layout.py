"""The README's Layout names every part of the package and every folder at the repository's top, and nothing
that is not there: a newcomer reads the tree from it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"^## Layout\n\n```\n(.*?)```", text, re.M | re.S).group(1)


def test_layout_lists_every_package_and_top_level_folder() -> None:
    block = layout_block()
    package = ROOT / "megatron_areal"
    parts = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    parts |= {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    local = {"megatron_areal", "runs", "__pycache__"}  # the package itself; what runs and builds leave behind
    top = {f"{p.name}/" for p in ROOT.iterdir()
           if p.is_dir() and not p.name.startswith(".") and p.name not in local and not p.name.endswith(".egg-info")}
    named = set(re.findall(r"([\w.]+/?)", block))
    assert parts - named == set(), f"README Layout omits {sorted(parts - named)}"
    assert top - named == set(), f"README Layout omits {sorted(top - named)}"
    listed = set(re.findall(r"^  ([\w.]+/|[\w.]+\.py)", block, re.M)) | set(re.findall(r", ([\w]+/)", block))
    assert listed <= parts, f"README Layout names parts that do not exist: {sorted(listed - parts)}"
