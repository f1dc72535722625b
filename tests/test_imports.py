"""The package's modules import one another without a cycle, imports inside functions counted: each module builds on
the ones below it, and a reader never has to follow a loop."""

import ast
from pathlib import Path

import medusa_decoding

PACKAGE = Path(medusa_decoding.__file__).parent


def module_name(path: Path) -> str:
    parts = ("medusa_decoding",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that `path` (module `name`) imports anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(above + ([node.module] if node.module else []))
            # `from .x import y` imports x (y may be a module too); `from . import x` imports x, not the package again
            found |= ({base} if node.module else set()) | {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported(path, name, set(paths)) for name, path in paths.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, as the modules along it, or None (depth-first search)."""
    state = {}  # module -> "open" while on the search path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module], path = "open", path + [module]
        for other in sorted(graph[module]):
            if state.get(other) == "open":  # on the path: back where it started
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other, path)):
                return found
        state[module] = "done"
        return None

    return next((found for module in sorted(graph) if module not in state and (found := visit(module, []))), None)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"medusa_decoding.model", "medusa_decoding.calibrate", "medusa_decoding.training.train"} <= set(graph)
    assert "medusa_decoding.calibrate" in graph["medusa_decoding.model"]  # lazy and top-level imports alike are seen
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
