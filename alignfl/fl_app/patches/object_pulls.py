"""Flower's object pulls ask again after 0.05 s, not 1 s, when an object is not there yet.

A message travels as a tree of objects (its records, arrays, chunks), pulled one by one with
``flwr.supercore.inflatable.inflatable_utils.pull_objects``, which waits 1 s (then 2, 4, ... up to 10 s) before it
asks again for an object its sender has not finished pushing. In a deployment that is most messages, not a corner
case: a SuperNode stores a pulled message and opens its ClientApp task before it has pulled the message's objects
from the SuperLink (``start_client_internal._pull_and_store_message``), so a ClientApp process started at once
finds the objects missing and sleeps a full second; a SuperNode that pulls a message as the ServerApp pushes it
meets the same. ``benchmarks/deploy_round.py`` found ClientApp processes of 0.4 CPU-s taking 1.5-3.3 s, most of it
in this wait (py-spy, ``benchmarks/RESULTS.md``).

:func:`retry_object_pulls_sooner` makes the first wait :data:`FIRST_RETRY_S` (then doubling as before, to the same
cap and the same limits on tries and time) in the process that calls it: the SuperNode
(:mod:`alignfl.fl_app.patches.polling_supernode`) and the warm parent of its ClientApp processes
(:mod:`alignfl.fl_app.patches.warm_parent`, whose children inherit it), and a deployed ServerApp. It changes when
objects are asked for, never what arrives. It is installed through :mod:`alignfl.fl_app.patches.seam`: where the
installed Flower is not one its pulls were read on, it warns once and changes nothing.
"""

from __future__ import annotations

from alignfl.fl_app.patches import seam

_PULLS = "flwr.supercore.inflatable.inflatable_utils"
PATCH = seam.Patch(
    lost="object pulls retry after Flower's 1 s, not 0.05 s",
    needs=(f"{_PULLS}.pull_objects", f"{_PULLS}.pull_and_inflate_object_from_tree"),
)
"""Both pull functions take a keyword-only ``initial_backoff`` whose default this changes."""
DEPLOYED_GRID = "flwr.superlink.grid.http_grid.HttpGrid"
"""A deployed ServerApp's grid, which pulls its replies' objects (the simulation's grid pulls none)."""
FIRST_RETRY_S = 0.05
"""Seconds before an object that was not there is asked for again the first time (Flower's: 1 s)."""


def retry_object_pulls_sooner(first_retry_s: float = FIRST_RETRY_S) -> bool:
    """Object pulls of this process wait ``first_retry_s`` before their first retry; whether that could be
    installed (where not, the seam has warned)."""

    def apply() -> None:
        for key in PATCH.needs:
            seam.get(key).__kwdefaults__["initial_backoff"] = first_retry_s

    return seam.install(PATCH, apply)


def retry_reply_pulls_sooner() -> bool:
    """In a deployed ServerApp (whose grid's module is then loaded), :func:`retry_object_pulls_sooner`; False
    elsewhere or where it cannot be installed."""
    return seam.loaded(DEPLOYED_GRID) and retry_object_pulls_sooner()
