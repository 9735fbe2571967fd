"""scripts/record_bench.py copies a bench's RESULT lines into docs/benchmarks.md: the parser, the table
update, and the repository's own page (every bench in bench/ has a row with a reproducing command)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("record_bench", ROOT / "scripts" / "record_bench.py")
record_bench = importlib.util.module_from_spec(_spec)
sys.modules["record_bench"] = record_bench
_spec.loader.exec_module(record_bench)

OUTPUT = """\
SmolLM2-135M: model.dtype=float32 -> both sides compute in float32; 1 threads
logprobs against fp32 transformers: ours max |diff| 1.91e-06, mean 2.10e-07
RESULT packing_speedup 2.314
RESULT packing_speedup_vs_sorted 1.207
ours with each sample's prompt packed whole: 1.102; RESULT-like text mid-line is not a RESULT
RESULT train_vs_hf 1.420
"""

DOC = """\
# Benchmarks

| bench | figures | machine | date | tree | command |
|---|---|---|---|---|---|
| `bench/serve.py` | serve_vs_hf 2.69 | Zen 4, 2 cores | 2026-01-02 | abc1234 | `python bench/serve.py` |
| `bench/train_step.py` | train_vs_hf 1.42 | Zen 4, 2 cores | 2026-01-01 | abc1234 | `python bench/train_step.py` |

## Log

| date | bench | figures | machine | tree | command |
|---|---|---|---|---|---|
| 2025-12-01 | `bench/serve.py` | serve_vs_hf 2.52 | Zen 4, 2 cores | 0ld0ld0 | `python bench/serve.py` |
"""


def test_parser_takes_the_result_lines_in_order() -> None:
    assert record_bench.parse_results(OUTPUT) == [
        ("packing_speedup", "2.314"), ("packing_speedup_vs_sorted", "1.207"), ("train_vs_hf", "1.420")]


def test_a_result_keeps_its_spread_in_parentheses() -> None:
    """bench/time_to_accuracy.py follows its figure with the spread over run pairs; the table keeps it."""
    line = "RESULT gain_per_minute_vs_plain 2.99 (min 1.06, max 1.20 over 2 x 2 run pairs)"
    assert record_bench.parse_results(f"runs\n{line}\n") == [
        ("gain_per_minute_vs_plain", "2.99 (min 1.06, max 1.20 over 2 x 2 run pairs)")]


@pytest.mark.parametrize(("line", "error"), [
    ("RESULT train_vs_hf", "out:2: 'RESULT train_vs_hf' is not 'RESULT <name> <number>'"),
    ("RESULT train_vs_hf fast", "out:2: 'fast' is not a number"),
    ("RESULT a b c", "out:2: 'RESULT a b c' is not"),
])
def test_parser_names_the_line_of_a_malformed_result(line: str, error: str) -> None:
    with pytest.raises(record_bench.RecordError, match=error.replace("'", ".").replace("<", ".").replace(">", ".")):
        record_bench.parse_results(f"warming up\n{line}\n", "out")


def test_a_new_figure_replaces_the_row_and_the_old_one_moves_to_the_top_of_the_log() -> None:
    row = record_bench.Row("bench/serve.py", "serve_vs_hf 2.75", "Xeon, 2 cores", "2026-02-03", "def5678",
                           "python bench/serve.py --threads 2")
    assert record_bench.record(DOC, row) == DOC.replace(
        "| `bench/serve.py` | serve_vs_hf 2.69 | Zen 4, 2 cores | 2026-01-02 | abc1234 | `python bench/serve.py` |",
        "| `bench/serve.py` | serve_vs_hf 2.75 | Xeon, 2 cores | 2026-02-03 | def5678 | "
        "`python bench/serve.py --threads 2` |").replace(
        "|---|---|---|---|---|---|\n| 2025-12-01",
        "|---|---|---|---|---|---|\n| 2026-01-02 | `bench/serve.py` | serve_vs_hf 2.69 | Zen 4, 2 cores | abc1234 | "
        "`python bench/serve.py` |\n| 2025-12-01")


def test_a_bench_without_a_row_gets_one_and_nothing_moves_to_the_log() -> None:
    row = record_bench.Row("bench/convert.py", "convert_roundtrip_s 39.950", "m", "2026-02-03", "t",
                           "python bench/convert.py")
    out = record_bench.record(DOC, row)
    assert out.count("\n| `bench/") == 3 and out.split("## Log")[1] == DOC.split("## Log")[1]
    assert "| `bench/train_step.py` |" in out.split(row.line())[0]  # appended after the last row


def test_saved_output_is_recorded_with_its_command(tmp_path: Path) -> None:
    doc, out = tmp_path / "benchmarks.md", tmp_path / "run.log"
    doc.write_text(DOC)
    out.write_text(OUTPUT)
    assert record_bench.main(["--doc", str(doc), "--output", str(out), "--machine", "test box",
                              "--command", "python bench/train_step.py --skip-packing"]) == 0
    row = [line for line in doc.read_text().splitlines() if line.startswith("| `bench/train_step.py`")]
    cells = record_bench.split_row(row[0])
    assert cells.figures == "packing_speedup 2.314; packing_speedup_vs_sorted 1.207; train_vs_hf 1.420"
    assert cells.machine == "test box" and cells.command == "python bench/train_step.py --skip-packing"
    assert "| 2026-01-01 | `bench/train_step.py` | train_vs_hf 1.42 |" in doc.read_text()


def test_a_failing_run_records_nothing(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    status = record_bench.main(["--doc", str(doc), "--", sys.executable, "bench/no_such_bench.py"])
    assert status != 0 and doc.read_text() == DOC


def test_every_bench_has_a_row_with_a_command_that_runs_it() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split(record_bench.LOG_HEADING)[0]
    rows = {r.bench: r for r in map(record_bench.split_row,
                                    (line for line in table.splitlines() if line.startswith("| `bench/")))}
    # a bench prints RESULT lines (bench/results.py defines them; mainjob.py and plain_grpo.py serve benches)
    benches = {f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py")
               if "RESULT" in p.read_text() and p.name != "results.py"}
    assert benches <= set(rows), f"benches without a row: {sorted(benches - set(rows))}"
    assert all((ROOT / bench).is_file() for bench in rows), sorted(rows)
    for bench, row in rows.items():
        assert bench in row.command.split(), f"{bench}: its command {row.command!r} does not run it"
