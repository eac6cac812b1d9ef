"""The project's import graph: no circle anywhere (the layers, and the wings of fl_app and core, are
pyproject.toml's import-linter contracts, run by tests/test_config.py), and every import of the project's own
modules goes through its one namespace, ``alignfl``."""

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alignfl",)
BARE = ("fl_app", "strategies", "models", "core", "plugins")
"""The sub-packages' names as top-level modules, as they were before ``alignfl``: generic names (a user's own
``models`` or ``core``) that an import of them would pick up instead."""
SCANNED = ("alignfl", "tests", "benchmarks", "hydra_plugins", "scripts")


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


def bare_imports(path: Path) -> list[str]:
    """The imports in ``path`` of a module named as one of :data:`BARE` (``import models``, ``from core.x import y``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path}:{node.lineno}: {module}" for module in modules if module.partition(".")[0] in BARE]
    return found


def test_nothing_imports_a_sub_package_by_its_bare_name():
    sources = [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(sources) > 200, sources
    found = [line for path in sources for line in bare_imports(path)]
    assert not found, found


def test_the_bare_import_scan_sees_one(tmp_path):
    """The check itself: bare imports are found, those through ``alignfl`` and relative ones are not."""
    source = tmp_path / "x.py"
    source.write_text(
        "import models\nfrom core.merging import bbp\nimport alignfl.core\nfrom alignfl import models\n"
        "from . import core\ndef f():\n    import strategies.fedma as fedma\n"
    )
    assert [line.split(": ")[1] for line in bare_imports(source)] == ["models", "core.merging", "strategies.fedma"]
