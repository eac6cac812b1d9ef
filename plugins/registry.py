"""Name → entry: how every kind of part (algorithm, model, data set, partitioner) makes itself known.

Each kind keeps one :class:`Registry` of its entries, frozen dataclasses with a ``name``
that describe the part (what builds it, its settings class, what it declares of itself).
A part registers with one call in its own module, ``REGISTRY.register(Entry("name", ...))``,
so adding one means adding that module and nothing grows a table or an if/elif elsewhere.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    """An entry of a registry."""

    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Generic[E]):
    """The entries of one kind, by name; a name is registered once, and an unknown one is refused listing the
    names there are.

    Parameters
    ----------
    kind : str
        What the entries are ("strategy", "model", ...), as error messages call them.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}

    def register(self, entry: E) -> E:
        """Add ``entry`` under ``entry.name``; a name taken already is refused."""
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} '{entry.name}' is already registered")
        self._entries[entry.name] = entry
        return entry

    def get(self, name: str) -> E:
        """The entry called ``name``, or a ValueError naming it and the names allowed."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {self.names()}") from None

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._entries)
