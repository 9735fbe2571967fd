"""A bench reports RESULT lines only once every check passed (bench/results.py), and bench/train_step.py
reports through it, never before its logprob check."""
from __future__ import annotations

import ast
import io
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from results import Results  # noqa: E402  (bench/ is a folder of scripts, not a package)


def emitted(results: Results) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return results.emit(out, err), out.getvalue(), err.getvalue()


def test_all_checks_passed_prints_every_result_in_order() -> None:
    results = Results("demo")
    results.add("packing_speedup", 2.34567)
    assert results.check(True, "never shown")
    results.add("train_vs_hf", 1.5, digits=2)
    assert emitted(results) == (0, "RESULT packing_speedup 2.346\nRESULT train_vs_hf 1.50\n", "")


def test_a_failed_check_withholds_every_result_and_exits_non_zero() -> None:
    results = Results("demo")
    results.add("packing_speedup", 2.0)  # measured before the check, as train_step's packing bench is
    assert not results.check(False, "logprobs differ by 0.3")
    status, out, err = emitted(results)
    assert status == 1 and out == ""
    assert "FAIL: logprobs differ by 0.3" in err and "no RESULT" in err


def test_nothing_measured_is_a_failure() -> None:
    assert emitted(Results("demo"))[:2] == (1, "")


def test_a_result_name_is_one_word() -> None:
    with pytest.raises(ValueError, match="one word"):
        Results("demo").add("train vs hf", 1.0)


def printed_results(path: Path) -> list[int]:
    """Lines of ``path`` where a ``print`` call's text starts with ``RESULT``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            for arg in node.args:
                first = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
                if isinstance(first, ast.Constant) and str(first.value).startswith("RESULT"):
                    lines.append(node.lineno)
    return lines


def test_train_step_reports_only_through_results() -> None:
    """Its packing figures used to be printed before, and regardless of, the logprob check."""
    assert printed_results(BENCH / "train_step.py") == []
    tree = ast.parse((BENCH / "train_step.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "Results" in names


def test_the_ast_reader_sees_a_printed_result(tmp_path: Path) -> None:
    script = tmp_path / "b.py"
    script.write_text('x = 1.0\nprint(f"RESULT speed {x:.3f}")\nprint("RESULT other 2")\nprint("done")\n')
    assert printed_results(script) == [2, 3]
