"""alignfl/plugins/registry.py: the one registry every kind of part (algorithm, model, data set, partitioner) uses."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from alignfl.core.data import DATASETS
from alignfl.core.partitioning.partitioners import PARTITIONERS
from alignfl.models.registry import MODELS
from alignfl.plugins.registry import Registry
from alignfl.strategies.registry import STRATEGIES


@dataclass(frozen=True)
class Part:
    name: str
    size: int = 0


def test_register_get_and_names():
    parts: Registry[Part] = Registry("part")
    small, large = Part("small", 1), Part("large", 9)
    assert parts.register(large) is large and parts.register(small) is small
    assert parts.get("small") is small and parts.names() == ["large", "small"]


def test_a_name_registers_once():
    parts: Registry[Part] = Registry("part")
    parts.register(Part("one"))
    with pytest.raises(ValueError, match="part 'one' is already registered"):
        parts.register(Part("one", 2))
    assert parts.get("one") == Part("one")


@pytest.mark.parametrize("name", ["three", ["one"]])
def test_an_unknown_name_is_refused_listing_the_names(name):
    parts: Registry[Part] = Registry("part")
    parts.register(Part("one"))
    parts.register(Part("two"))
    with pytest.raises(ValueError, match=r"unknown part .*; allowed: \['one', 'two'\]"):
        parts.get(name)


@pytest.mark.parametrize(
    ("registry", "kind", "known"),
    [
        (STRATEGIES, "strategy", "fedavg"),
        (MODELS, "model", "mlp"),
        (DATASETS, "dataset", "digits"),
        (PARTITIONERS, "partitioner", "dirichlet"),
    ],
)
def test_every_kind_of_part_registers_the_same_way(registry, kind, known):
    assert isinstance(registry, Registry) and registry.kind == kind
    assert registry.get(known).name == known and known in registry.names()
    with pytest.raises(ValueError, match=f"unknown {kind} 'nothing'; allowed: .*'{known}'"):
        registry.get("nothing")


def test_a_module_dropped_into_a_package_of_parts_registers_itself(tmp_path, monkeypatch):
    """The package's ``__init__`` imports every module in it (not ``_``-prefixed ones): no import line to add."""
    package = tmp_path / "toyparts"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from alignfl.plugins.registry import Registry, import_modules\n"
        "PARTS = Registry('part')\n"
        "IMPORTED = import_modules(__name__, __path__)\n"
    )
    for name in ("beta", "alpha"):
        (package / f"{name}.py").write_text(
            f"from toyparts import PARTS\nfrom tests.test_registry import Part\nPARTS.register(Part('{name}'))\n"
        )
    (package / "_draft.py").write_text("raise RuntimeError('a draft is never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import toyparts

    assert toyparts.IMPORTED == ["toyparts.alpha", "toyparts.beta"]
    assert toyparts.PARTS.names() == ["alpha", "beta"]


def test_every_module_of_strategies_and_models_is_imported():
    from alignfl import models, strategies

    for package in (models, strategies):
        modules = [name for name in sys.modules if name.startswith(f"{package.__name__}.")]
        files = [f"{package.__name__}.{p.stem}" for p in Path(package.__file__).parent.glob("[!_]*.py")]
        assert set(files) <= set(modules)


FIRST_IMPORTS = [
    "alignfl.models.cnn",
    "alignfl.models.registry",
    "alignfl.strategies.fedma",
    "alignfl.strategies.registry",
]

FRESH_IMPORTS = """
import importlib, json, sys
import torch, flwr  # what every order shares, imported once; alignfl itself is imported afresh for each
counts = {}
for first in sys.argv[1:]:
    for name in [name for name in sys.modules if name == "alignfl" or name.startswith("alignfl.")]:
        del sys.modules[name]
    try:
        importlib.import_module(first)
        from alignfl import models, strategies
        counts[first] = [len(models.list_models()), len(strategies.list_strategies())]
    except Exception as error:
        counts[first] = f"{type(error).__name__}: {error}"
print(json.dumps(counts))
"""
"""One interpreter imports alignfl from nothing once per first module (a start-up each would cost seconds)."""


@pytest.fixture(scope="module")
def counts_by_first_import() -> dict[str, list[int] | str]:
    result = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORTS, *FIRST_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_whichever_module_is_imported_first_every_part_registers(first, counts_by_first_import):
    """A package's ``__init__`` runs before any of its modules and imports them all last, after the names they
    import from it: no import order leaves a part unregistered or meets a half-made package."""
    from alignfl import models, strategies

    assert counts_by_first_import[first] == [len(models.list_models()), len(strategies.list_strategies())]
