"""Flower's object pulls ask again after 0.05 s, not 1 s, when an object is not there yet.

A message travels as a tree of objects (its records, arrays, chunks), pulled one by one with
``flwr.supercore.inflatable.inflatable_utils.pull_objects``, which waits 1 s (then 2, 4, ... up to 10 s) before it
asks again for an object its sender has not finished pushing. In a deployment that is most messages, not a corner
case: a SuperNode stores a pulled message and opens its ClientApp task before it has pulled the message's objects
from the SuperLink (``start_client_internal._pull_and_store_message``), so a ClientApp process started at once
finds the objects missing and sleeps a full second; a SuperNode that pulls a message as the ServerApp pushes it
meets the same. ``benchmarks/deploy_round.py`` found ClientApp processes of 0.4 CPU-s taking 1.5-3.3 s, most of it
in this wait (py-spy, RESULTS.md).

:func:`retry_object_pulls_sooner` makes the first wait :data:`FIRST_RETRY_S` (then doubling as before, to the same
cap and the same limits on tries and time) in the process that calls it: the SuperNode
(:mod:`fl_app.patches.polling_supernode`) and the warm parent of its ClientApp processes (:mod:`fl_app.patches.warm_parent`, whose
children inherit it). It changes when objects are asked for, never what arrives. It is installed only on the
Flower releases whose pulls were read (:data:`CHECKED_FLOWER`); anywhere else it says why and changes nothing.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version

CHECKED_FLOWER = frozenset({"1.41.0", "1.42.0"})
"""Flower releases whose object pulls (``pull_objects`` and ``pull_and_inflate_object_from_tree``, keyword-only
``initial_backoff``) this was checked against."""
PULLS_MODULE = "flwr.supercore.inflatable.inflatable_utils"
PULL_FUNCTIONS = ("pull_objects", "pull_and_inflate_object_from_tree")
FIRST_RETRY_S = 0.05
"""Seconds before an object that was not there is asked for again the first time (Flower's: 1 s)."""


def retry_object_pulls_sooner(first_retry_s: float = FIRST_RETRY_S) -> str | None:
    """Object pulls of this process wait ``first_retry_s`` before their first retry; why not, or None."""
    flower = version("flwr")
    if flower not in CHECKED_FLOWER:
        return f"Flower {flower} is not a release it was checked against ({', '.join(sorted(CHECKED_FLOWER))})"
    pulls = importlib.import_module(PULLS_MODULE)
    functions = [getattr(pulls, name, None) for name in PULL_FUNCTIONS]
    if not all(callable(function) and "initial_backoff" in (function.__kwdefaults__ or {}) for function in functions):
        return f"{PULLS_MODULE} has no {' and '.join(PULL_FUNCTIONS)} with a keyword initial_backoff"
    for function in functions:
        function.__kwdefaults__["initial_backoff"] = first_retry_s
    return None
