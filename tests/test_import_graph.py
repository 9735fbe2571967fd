"""The package's parts depend on each other in one direction: the import graph between the
subpackages and top-level modules of ``megatron_areal`` (read from the source by AST, every import
counted, also those inside functions) has no cycle.

One kind of import is not an edge: ``megatron_areal/config.py`` assembling the parts' sections of
the configuration tree (``<part>/config.py``). A section sits next to its component but is a leaf
(``test_config_sections_are_leaves``), so the parts that read the whole tree (the launcher, the
simulator, the trainer) stay above ``config`` without a cycle through the part that owns a section.

``python tests/test_import_graph.py`` prints the graph.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_areal

ROOT = Path(megatron_areal.__file__).parent


def _part(path: Path) -> str:
    """The subpackage (first folder) or top-level module a file belongs to."""
    rel = path.relative_to(ROOT).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the package imports absolutely"
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _package_imports(path: Path) -> list[list[str]]:
    """The package's modules ``path`` imports, as name pieces after ``megatron_areal``."""
    pieces = (name.split(".") for name in _imported_modules(path))
    return [p[1:] for p in pieces if p[0] == "megatron_areal" and len(p) > 1]


def _is_section(pieces: list[str]) -> bool:
    return len(pieces) >= 2 and pieces[1] == "config"


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        part = _part(path)
        deps = graph.setdefault(part, set())
        for pieces in _package_imports(path):
            if part == "config" and _is_section(pieces):
                continue  # the tree assembling its sections (leaves, see the module docstring)
            if pieces[0] != part:
                deps.add(pieces[0])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def render(graph: dict[str, set[str]]) -> str:
    width = max(map(len, graph))
    return "\n".join(f"{part:<{width}} -> {', '.join(sorted(graph[part])) or '-'}" for part in sorted(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_model_is_below_every_part_that_uses_it():
    graph = import_graph()
    assert graph["model"] <= {"configbase"}, graph["model"]
    users = {part for part, deps in graph.items() if "model" in deps}
    assert {"actor", "server", "convert", "realloc", "launch", "sim"} <= users


def test_config_sections_are_leaves():
    """A part's section imports only ``configbase`` and its own part's modules that import nothing
    of the package (say, the simulator's table of GPUs)."""
    for section in sorted(ROOT.glob("*/config.py")):
        for pieces in _package_imports(section):
            if pieces[0] == "configbase":
                continue
            assert pieces[0] == section.parent.name, f"{section} imports megatron_areal.{'.'.join(pieces)}"
            module = ROOT.joinpath(*pieces[:2]).with_suffix(".py")
            assert not _package_imports(module), f"{section} imports {module}, which imports the package"


def test_parts_import_each_other_without_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}\n{render(graph)}"


if __name__ == "__main__":
    graph = import_graph()
    print(render(graph))
    print("cycle:", " -> ".join(find_cycle(graph) or ["none"]))
