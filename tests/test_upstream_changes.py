"""Our changes to third-party behaviour (megatron_areal/patches/upstream.py) still fit the installed upstream:
each names a pinned version and the source it relies on, and a moved site or another version fails here, with a
message naming the change, the module and the text, instead of silently running unpatched code."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_areal.patches import upstream
from megatron_areal.patches.upstream import CHANGES, Change, Expect, UpstreamChanged, check, problems
from megatron_areal.patches.version import MEGATRON_CORE_VERSION

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.name)
def test_the_pinned_upstream_still_has_what_the_change_relies_on(change: Change) -> None:
    assert problems(change) == []


def test_a_moved_site_is_named() -> None:
    change = CHANGES[1]
    moved = dataclasses.replace(change, expects=(Expect(change.expects[0].module, "def te_router_gemm_v2("),))
    (problem,) = problems(moved)
    assert change.name in problem and change.expects[0].module in problem and "te_router_gemm_v2" in problem
    with pytest.raises(UpstreamChanged, match="te_router_gemm_v2"):
        check((moved,))


def test_another_version_is_named() -> None:
    change = dataclasses.replace(CHANGES[0], version="0.15.0")
    (problem,) = problems(change)
    assert re.search(r"megatron-core \S+ is installed; the change is written against 0\.15\.0", problem), problem


def test_a_missing_module_or_distribution_is_named() -> None:
    gone = Change("x", "megatron-core", MEGATRON_CORE_VERSION, "why", "nowhere",
                  (Expect("megatron.core.no_such_module", "x"),))
    assert problems(gone) == ["x: module megatron.core.no_such_module is not installed as source"]
    absent = Change("y", "no-such-distribution", "1.0", "why", "nowhere", ())
    assert problems(absent) == ["y: no-such-distribution is not installed"]


def test_the_source_is_read_as_shipped_even_where_a_change_is_applied() -> None:
    from megatron_areal.patches import packed_rope

    packed_rope.install()  # rebinds rope_utils._apply_rotary_pos_emb_thd in this process
    assert "def _apply_rotary_pos_emb_thd(" in upstream.source_of(upstream._ROPE)


def test_every_change_is_applied_where_it_says_and_listed_in_the_index() -> None:
    index = (ROOT / "patches" / "README.md").read_text()
    for change in CHANGES:
        path, _, what = change.applied_by.partition(": ")
        function = what.split("(")[0]
        assert path.startswith("megatron_areal/patches/"), f"{change.name} is applied outside megatron_areal/patches/"
        assert f"def {function}(" in (ROOT / path).read_text(), f"{change.name}: {function} is not in {path}"
        assert f"`{change.name}`" in index and f"`{path}`" in index, f"patches/README.md does not list {change.name}"


def test_each_module_of_the_patches_package_is_a_change_a_part_of_one_or_the_index() -> None:
    applied = {change.applied_by.partition(": ")[0] for change in CHANGES}
    modules = {f"megatron_areal/patches/{p.name}" for p in (ROOT / "megatron_areal" / "patches").glob("*.py")}
    index = {"megatron_areal/patches/__init__.py", "megatron_areal/patches/upstream.py",
             "megatron_areal/patches/version.py"}
    assert applied <= modules
    for helper in sorted(modules - index - applied):  # a part of a change: a module that applies one uses it
        name = helper.removesuffix(".py").replace("/", ".")
        assert any(name in (ROOT / path).read_text() for path in applied), f"{helper} belongs to no change"


def test_setup_pins_the_one_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py's requirement, as setuptools receives it, is the version of patches/version.py, and no other
    file of the package or setup.py spells a megatron-core version as a string."""
    import runpy

    import setuptools

    received: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: received.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"))
    assert f"megatron-core=={MEGATRON_CORE_VERSION}" in received["install_requires"]
    assert all(change.version == MEGATRON_CORE_VERSION for change in CHANGES if change.upstream == "megatron-core")
    literal = f'"{MEGATRON_CORE_VERSION}"'
    spelled = [str(p.relative_to(ROOT)) for p in [ROOT / "setup.py", *(ROOT / "megatron_areal").rglob("*.py")]
               if literal in p.read_text()]
    assert spelled == ["megatron_areal/patches/version.py"]


def test_another_installed_version_is_refused_naming_both() -> None:
    """The check as the trainer runs it, handed the version a different install would report."""
    with pytest.raises(UpstreamChanged) as refused:
        check(installed={"megatron-core": "0.17.0"})
    message = str(refused.value)
    for change in CHANGES:
        assert f"{change.name}: megatron-core 0.17.0 is installed; the change is written against " \
               f"{MEGATRON_CORE_VERSION}" in message
    check(installed={"megatron-core": MEGATRON_CORE_VERSION})  # the pinned version passes


def test_the_trainer_checks_the_upstream_before_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A trainer rank whose megatron-core differs from a change's version stops before it reads its config or
    waits for servers, with the check's error (here a change written against another release)."""
    from megatron_areal.trainer.__main__ import main

    monkeypatch.setattr(upstream, "CHANGES", (dataclasses.replace(CHANGES[0], version="0.15.0"),))
    with pytest.raises(UpstreamChanged, match=r"cpu-gloo: megatron-core \S+ is installed; the change is written "
                                              r"against 0\.15\.0"):
        main(["--plan", str(tmp_path / "plan.json"), str(tmp_path / "no-config.yaml")])
