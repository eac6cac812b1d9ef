"""The project's import graph: no circle anywhere (the layers, and the wings of fl_app and core, are
pyproject.toml's import-linter contracts, run by tests/test_config.py)."""

from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plugins", "models", "core", "strategies", "fl_app")


def project_roots() -> list[str]:
    """Every package of the project, each Hydra plugin of ``hydra_plugins/`` included (the namespace package
    also holds plugins installed from PyPI, which are not ours)."""
    plugins = sorted(f"hydra_plugins.{path.name}" for path in (ROOT / "hydra_plugins").iterdir() if path.is_dir())
    return [*PACKAGES, *(name for name in plugins if not name.endswith("__pycache__"))]


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module that imports itself): each is a
    set of modules that import one another in a circle. Every import counts, those inside functions too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_the_project_imports_itself_through_others():
    graph = grimp.build_graph(*project_roots())
    assert len(graph.modules) > 100, sorted(graph.modules)
    assert not circles(graph), circles(graph)


def test_a_circle_is_found():
    """The check itself: two modules that import each other are one circle."""
    graph = grimp.ImportGraph()
    for importer, imported in [("a.x", "a.y"), ("a.y", "a.x"), ("a.y", "a.z")]:
        graph.add_import(importer=importer, imported=imported)
    assert circles(graph) == [["a.x", "a.y"]]
