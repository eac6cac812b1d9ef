"""plugins/registry.py: the one registry every kind of part (algorithm, model, data set, partitioner) uses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from core.data import DATASETS
from core.partitioning.partitioners import PARTITIONERS
from models.registry import MODELS
from plugins.registry import Registry
from strategies.registry import STRATEGIES


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
