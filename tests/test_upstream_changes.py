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
    gone = Change("x", "megatron-core", "0.16.1", "why", "nowhere", (Expect("megatron.core.no_such_module", "x"),))
    assert problems(gone) == ["x: module megatron.core.no_such_module is not installed as source"]
    absent = Change("y", "no-such-distribution", "1.0", "why", "nowhere", ())
    assert problems(absent) == ["y: no-such-distribution is not installed"]


def test_the_source_is_read_as_shipped_even_where_a_change_is_applied() -> None:
    from megatron_areal.actor import packed_rope

    packed_rope.install()  # rebinds rope_utils._apply_rotary_pos_emb_thd in this process
    assert "def _apply_rotary_pos_emb_thd(" in upstream.source_of(upstream._ROPE)


def test_every_change_is_applied_where_it_says_and_listed_in_the_index() -> None:
    index = (ROOT / "patches" / "README.md").read_text()
    for change in CHANGES:
        path, _, what = change.applied_by.partition(": ")
        function = what.split("(")[0]
        assert function in (ROOT / path).read_text(), f"{change.name}: {function} is not in {path}"
        assert f"`{change.name}`" in index, f"patches/README.md does not list {change.name}"
        assert f"{change.upstream}=={change.version}" in (ROOT / "setup.py").read_text().replace('"', ""), \
            f"{change.name}: setup.py does not pin {change.upstream}=={change.version}"
