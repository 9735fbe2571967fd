"""The package's parts depend on each other in one direction: the import graph between the subpackages and
top-level modules of ``megatron_areal`` (read from the source by AST, every import counted, also those inside
functions: a lazy import still ties two parts together) has no cycle, and the launcher (``launch/``) is
imported only by the command line.

No import is exempt. The configuration tree (``megatron_areal/config.py``) imports every part's section;
the sections of the parts that read the whole tree (the launcher's ``cluster:``, the simulator's ``sim:``)
therefore live in ``megatron_areal/cluster/``, below the tree, and every section is a leaf
(``test_config_sections_are_leaves``).

``python tests/test_import_graph.py`` prints the graph.
"""
from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_areal.cli import COMMANDS
from megatron_areal.config import Config

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_areal"
Graph = dict[str, dict[str, list[str]]]  # part -> imported part -> the importing files


def part_of(module: str) -> str | None:
    """``megatron_areal.fleet.fleet`` -> ``rollout``; None outside the package."""
    names = module.split(".")
    return names[1] if names[0] == "megatron_areal" and len(names) > 1 else None


def module_name(path: Path) -> str:
    return ".".join(("megatron_areal", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def imported_modules(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (``from a import b`` gives ``a.b``: b may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the package imports absolutely"
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def package_graph() -> Graph:
    graph: Graph = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(module_name(path))
        for name in imported_modules(path):
            target = part_of(name)
            if target and source and target != source:
                graph[source][target].append(str(path.relative_to(PACKAGE.parent)))
    return graph


def render(graph: Graph) -> str:
    width = max(map(len, graph))
    return "\n".join(f"{part:<{width}} -> {', '.join(sorted(graph[part])) or '-'}" for part in sorted(graph))


def find_cycle(edges: dict[str, set[str]] | Graph) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None when the graph has none (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize(("edges", "cyclic"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),  # a diamond is not a cycle
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"x": set(), "a": {"b"}, "b": {"c"}, "c": {"b"}}, True),  # a cycle not through the first node
])
def test_find_cycle_on_hand_drawn_graphs(edges: dict[str, set[str]], cyclic: bool) -> None:
    cycle = find_cycle(edges)
    assert (cycle is not None) == cyclic
    if cycle:
        assert cycle[0] == cycle[-1] and all(b in edges[a] for a, b in zip(cycle, cycle[1:]))


def test_imports_inside_functions_are_read() -> None:
    graph = package_graph()
    assert "trainer" in graph and "rollout" in graph["trainer"]
    # evaluation/held_out.py is imported lazily inside a function of trainer/rank0.py
    assert "megatron_areal/trainer/rank0.py" in graph["trainer"]["evaluation"]


def test_no_cycle_between_parts_of_the_package() -> None:
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} in {', '.join(sorted(set(graph[a][b])))}" for a, b in zip(cycle, cycle[1:]))


def test_model_is_below_every_part_that_uses_it() -> None:
    graph = package_graph()
    assert set(graph["model"]) <= {"configbase"}, dict(graph["model"])
    users = {part for part, deps in graph.items() if "model" in deps}
    assert {"actor", "server", "convert", "weights", "launch", "sim"} <= users


def module_of(name: str) -> str:
    """The module an imported name lives in: ``megatron_areal.weights.wire.join_group`` -> ``...weights.wire``."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        where = PACKAGE.joinpath(*parts[1:n])
        if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file():
            return ".".join(parts[:n])
    return name


def modules_imported_from(part: str, target: str) -> dict[str, list[str]]:
    """{module of part ``target``: the files of part ``part`` that import it}."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for name in imported_modules(path):
            if part_of(name) == target:
                out[module_of(name)].append(str(path.relative_to(PACKAGE.parent)))
    return out


# the modules of the weight path both ends share: the group and checksums, and a shard push's receiving side
WIRE = {"megatron_areal.weights.wire", "megatron_areal.weights.shard_receive"}


@pytest.mark.parametrize("receiver", ["server", "vllm_plugin"])
def test_receivers_import_only_the_wire_protocol_of_the_weight_path(receiver: str) -> None:
    """The servers (embedded, and vLLM's plugin) take part in the weight push through ``weights/wire.py`` and
    ``weights/shard_receive.py`` alone: they pull in neither Megatron (the trainer side of the weight path)
    nor the rollout side."""
    graph = package_graph()
    assert "weights" in graph[receiver]
    assert set(modules_imported_from(receiver, "weights")) <= WIRE, dict(modules_imported_from(receiver, "weights"))
    for module in sorted(WIRE):
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        # of the package, they import only leaves of util/ (pure torch helpers that import nothing of the package)
        ours = [m for m in imported_modules(path) if m.startswith("megatron_areal.")]
        assert all(m.startswith("megatron_areal.util.") for m in ours), f"{path.name} imports the package: {ours}"
        for name in ours:
            leaf = PACKAGE.parent / (module_of(name).replace(".", "/") + ".py")
            assert [m for m in imported_modules(leaf) if m.startswith("megatron_areal.")] == [], f"{leaf} is not a leaf"
    init = PACKAGE / "weights" / "__init__.py"
    assert [m for m in imported_modules(init) if m.startswith("megatron_areal.")] == []
    assert not {"rollout", "fleet", "actor"} & set(graph[receiver]), dict(graph[receiver])


def test_the_weight_path_and_the_fleet_do_not_pass_through_rollout() -> None:
    """A push goes trainer -> ``weights/`` -> ``fleet/`` -> the servers; ``rollout/`` is a user of the fleet."""
    graph = package_graph()
    assert "rollout" not in graph["weights"], dict(graph["weights"])
    assert "rollout" not in graph["fleet"], dict(graph["fleet"])
    assert "fleet" in graph["rollout"] and "fleet" in graph["weights"]


def test_config_sections_are_leaves() -> None:
    """Each section of the tree imports only ``configbase`` and modules of its own part that import nothing
    of the package (say, the table of GPUs), so assembling the tree ties no part to a reader of the tree."""
    sections = {type(value).__module__ for value in vars(Config()).values()}
    for section in sorted(sections - {"megatron_areal.config"}):
        path = PACKAGE.joinpath(*section.split(".")[1:]).with_suffix(".py")
        for name in imported_modules(path):
            if not name.startswith("megatron_areal.") or name.startswith("megatron_areal.configbase."):
                continue
            assert part_of(name) == part_of(section), f"{path} imports {name}"
            module = PACKAGE.joinpath(*name.split(".")[1:-1]).with_suffix(".py")
            leaf = [m for m in imported_modules(module) if m.startswith("megatron_areal.")]
            assert not leaf, f"{path} imports {module}, which imports {leaf}"


def module_path(module: str) -> Path:
    """``megatron_areal.evaluation.cli`` -> its file."""
    return PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")


def command_files() -> set[str]:
    """The files of the command modules ``cli.py`` names (``megatron_areal/evaluation/cli.py`` for ``eval``)."""
    return {str(module_path(module).relative_to(PACKAGE.parent)) for module, _ in COMMANDS.values()}


def test_launch_is_imported_only_by_the_command_line() -> None:
    """``launch/`` starts processes; only the command line may import it: ``cli.py`` and the command modules it
    names (``megatron-areal eval`` starts an embedded server), and no module of the package imports those."""
    commands = command_files()
    importers = {source: sorted(set(files) - commands) for source, targets in package_graph().items()
                 for target, files in targets.items() if target == "launch" and set(files) - commands}
    assert importers == {}, f"launch/ is the command line's; import megatron_areal.run instead: {importers}"
    # a command module that imports launch/ is an entry point: nothing else imports it
    launching = {module for module, _ in COMMANDS.values()
                 if any(part_of(name) == "launch" for name in imported_modules(module_path(module)))}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "cli.py":
            names = imported_modules(path)
            assert not launching & {*names, *(name.rsplit(".", 1)[0] for name in names)}, f"{path} imports {launching}"


def test_the_command_line_reaches_every_command_module() -> None:
    """``cli.py`` names its commands as strings (imported on use); each must import and have ``main``."""
    for name, (module, _) in COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), "main", None)), name


if __name__ == "__main__":
    graph = package_graph()
    print(render(graph))
    print("cycle:", " -> ".join(find_cycle(graph) or ["none"]))
    for receiver in ("server", "vllm_plugin"):
        print(f"{receiver} imports of the weight path:", ", ".join(sorted(modules_imported_from(receiver, "weights"))))
