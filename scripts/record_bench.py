"""Copy a bench's ``RESULT name value`` lines into docs/benchmarks.md, so that no figure is retyped by hand.

    python scripts/record_bench.py [--machine TEXT] [--note TEXT] -- python bench/serve.py --threads 2
    python scripts/record_bench.py --output run.log --command "python bench/serve.py --threads 2"

The first form runs the command (its output passes through) and records only when it exits 0: a bench
prints RESULT lines only after its checks passed (bench/results.py), and a failed run records nothing.
The second reads the output of a run made earlier. Either way the bench's row in the table of
docs/benchmarks.md gets the figures, the machine (this machine's CPU model and core count unless
``--machine`` says otherwise), today's date (UTC), the tree (``git describe --always --dirty``) and the
command; the row it replaces moves to the top of the dated log below the table.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
# "RESULT name value", optionally followed by what qualifies it in parentheses (a spread over runs)
RESULT = re.compile(r"^RESULT (?P<name>\S+) (?P<value>\S+)(?P<spread> \([^()]*\))?\s*$")
LOG_HEADING = "## Log"
LOG_HEADER = "| date | bench | figures | machine | tree | command |"

logger = logging.getLogger("record_bench")


class RecordError(ValueError):
    """Bad bench output or a docs/benchmarks.md this script cannot update; the message says where."""


@dataclass(frozen=True)
class Row:
    """One bench's latest figures, as a row of the table."""

    bench: str  # bench/<name>.py
    figures: str  # "name value; name value"
    machine: str
    date: str
    tree: str
    command: str

    def cells(self) -> list[str]:
        return [f"`{self.bench}`", self.figures, self.machine, self.date, self.tree, f"`{self.command}`"]

    def line(self) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in self.cells()) + " |"

    def log_line(self) -> str:
        cells = [self.date, f"`{self.bench}`", self.figures, self.machine, self.tree, f"`{self.command}`"]
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def parse_results(text: str, source: str = "output") -> list[tuple[str, str]]:
    """The ``(name, value)`` of every RESULT line, in order; a parenthesised spread after the number stays
    with the value. A line that starts with ``RESULT`` but is not ``RESULT <name> <number> [(...)]`` is an
    error naming its line number."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("RESULT"):
            continue
        match = RESULT.match(line)
        if not match:
            raise RecordError(f"{source}:{number}: {line!r} is not 'RESULT <name> <number>'")
        try:
            float(match["value"])
        except ValueError:
            raise RecordError(f"{source}:{number}: {match['value']!r} is not a number") from None
        found.append((match["name"], match["value"] + (match["spread"] or "")))
    return found


def bench_of(command: list[str]) -> str:
    """The ``bench/<name>.py`` a command runs."""
    for word in command:
        if re.fullmatch(r"(\./)?bench/[\w-]+\.(py|sh)", word):
            return word.removeprefix("./")
    raise RecordError(f"command {shlex.join(command)!r} runs no bench/<name>.py")


def this_machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def this_tree() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def record(doc: str, row: Row) -> str:
    """``doc`` with ``row`` in the table in place of the bench's previous row, which moves to the top of the
    log. A bench without a row gets one at the end of the table."""
    lines = doc.splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("| `bench/")]
    if not table:
        raise RecordError("docs/benchmarks.md: no table rows starting with '| `bench/' found")
    mine = [i for i in table if lines[i].startswith(f"| `{row.bench}` |")]
    old = None
    if mine:
        old = split_row(lines[mine[0]])
        lines[mine[0]] = row.line()
    else:
        lines.insert(table[-1] + 1, row.line())
    if old is not None:
        try:
            header = lines.index(LOG_HEADER)
        except ValueError:
            raise RecordError(f"docs/benchmarks.md: the log's header {LOG_HEADER!r} is missing") from None
        lines.insert(header + 2, old.log_line())  # below the header and its |---| line
    return "\n".join(lines) + "\n"


def split_row(line: str) -> Row:
    cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    if len(cells) != 6:
        raise RecordError(f"docs/benchmarks.md: row {line!r} does not have 6 cells")
    bench, figures, machine, date, tree, command = cells
    return Row(bench.strip("`"), figures, machine, date, tree, command.strip("`"))


def run(command: list[str]) -> tuple[int, str]:
    """Run ``command`` from the repository root, passing its output through; returns (status, output)."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    captured = []
    for line in proc.stdout:
        sys.stdout.write(line)
        captured.append(line)
    return proc.wait(), "".join(captured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="read the RESULT lines from this saved output instead")
    parser.add_argument("--command", help="with --output: the command that produced it")
    parser.add_argument("--machine", default=None, help="what ran it (default: this CPU, its cores)")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ... (the bench to run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.output:
        if command or not args.command:
            parser.error("--output takes --command (the command that produced it) and no COMMAND")
        command, text, source = shlex.split(args.command), args.output.read_text(), str(args.output)
    else:
        if not command:
            parser.error("give the bench to run after --, or --output with --command")
        status, text = run(command)
        if status != 0:
            logger.error("%s exited with %d; nothing recorded", shlex.join(command), status)
            return status
        source = "output"
    try:
        results = parse_results(text, source)
        if not results:
            raise RecordError(f"{source}: no RESULT line; nothing recorded")
        row = Row(bench=bench_of(command), figures="; ".join(f"{n} {v}" for n, v in results),
                  machine=args.machine or this_machine(), date=datetime.datetime.now(datetime.UTC).date().isoformat(),
                  tree=this_tree(), command=shlex.join(command))
        args.doc.write_text(record(args.doc.read_text(), row))
    except RecordError as e:
        logger.error("%s", e)
        return 1
    logger.info("recorded %s in %s: %s", row.bench, args.doc, row.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
