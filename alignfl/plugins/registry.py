"""Name → entry: how every kind of part (algorithm, model, data set, partitioner) makes itself known.

Each kind keeps one :class:`Registry` of its entries, frozen dataclasses with a ``name``
that describe the part (what builds it, its settings class, what it declares of itself).
A part registers with one call in its own module, ``REGISTRY.register(Entry("name", ...))``,
and a package of parts imports all its modules (:func:`import_modules`), so adding one means
dropping that module into the package: nothing grows an import line, a table or an if/elif.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
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


def import_modules(package: str, path: Iterable[str]) -> list[str]:
    """Import every module of ``package`` (found on its ``__path__``), so each registers what it declares.

    A package of parts (``alignfl.strategies``, ``alignfl.models``) calls this at the end of its ``__init__``,
    after the names its modules import from it, so a module dropped into the package registers itself with no
    other line to edit. Modules whose name starts with ``_`` are left out (drafts, private helpers).

    Parameters
    ----------
    package : str
        The package's dotted name (its ``__name__``).
    path : iterable of str
        The package's ``__path__``.

    Returns
    -------
    list of str
        The dotted names imported, in file-name order.
    """
    names = [f"{package}.{module.name}" for module in pkgutil.iter_modules(path) if not module.name.startswith("_")]
    for name in names:
        importlib.import_module(name)
    return names
