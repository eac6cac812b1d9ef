"""What alignfl changes in Flower's simulation runtime, where it costs per node: the message lookup of its
in-memory state, and asking every node for its partition.

Flower's simulation loop (``vce_api.add_messages_to_queue``) asks the state for each node's next message every
0.1 s, and ``InMemoryLinkState.get_message_ins`` answers by running its validity check (expiry, federation) on
every stored message in turn until one is for that node: a sweep over the nodes costs nodes × messages in flight,
about 3 µs each. A QUERY to each of 1,000 nodes (how the round runner learns the partitions) makes one sweep take
1.5–3 s while holding the interpreter from the workers, and at 10,000 nodes one sweep takes minutes
(``benchmarks/linkstate_sweep.py``; RESULTS.md, issue 18).

:func:`index_message_lookup` gives the state a per-node list of message ids, kept by the one method that stores
messages, and answers the lookup from that node's list: the same messages in the same order, marked delivered
the same way, the same check on each, so expired or foreign messages of that node are deleted as before; those
of other nodes are deleted when their own node is asked (every sweep asks every node). It is installed only on
the Flower releases whose two methods were read and compared (:data:`CHECKED_FLOWER`); on any other the state
keeps Flower's own lookup and the log says so.

:func:`prepare_simulation` installs it and reads which partition each node holds from the same state: Flower's
simulation registers its nodes in a loop and gives the i-th partition i (``vce_api._register_nodes``), and the
state keeps its nodes in registration order. The round runner then asks one node instead of every node
(:class:`core.nodes.NodeDirectory`, which checks that node's answer against the table).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib.metadata import version
from logging import WARNING

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from core.nodes import PartitionTable
from fl_app.patches.ray_pool import drop_lost_actors

try:  # Flower's internals: where a release moved one, the simulation keeps Flower's own lookup (see checked_flower)
    from flwr.server.superlink.linkstate import InMemoryLinkState
    from flwr.supercore.date import now
    from flwr.superlink.grid import InMemoryGrid
except ImportError as missing:
    InMemoryLinkState = InMemoryGrid = now = None  # type: ignore[assignment,misc]
    MISSING_INTERNALS: str | None = f"{type(missing).__name__}: {missing}"
else:
    MISSING_INTERNALS = None

CHECKED_FLOWER = frozenset({"1.41.0", "1.42.0"})
"""Flower releases this module was checked against: their in-memory state, its grid and the simulation's node
registration (``in_memory_linkstate.py``, ``inmemory_grid.py``, ``vce_api.py``) are the same code in both."""

_INDEX = "_alignfl_message_ids_by_node"
_flower_store: Callable[..., str | None] | None = getattr(InMemoryLinkState, "store_message_ins", None)
_flower_lookup: Callable[..., list[Message]] | None = getattr(InMemoryLinkState, "get_message_ins", None)


def _node_index(state: InMemoryLinkState) -> dict[int, list[str]]:
    """The state's node -> stored message ids index, built from the store the first time it is needed."""
    index = state.__dict__.get(_INDEX)
    if index is None:
        index = {}
        for message_id, message in state.message_ins_store.items():
            index.setdefault(message.metadata.dst_node_id, []).append(message_id)
        state.__dict__[_INDEX] = index
    return index


def store_message_ins(state: InMemoryLinkState, message: Message) -> str | None:
    """Flower's ``store_message_ins``, then the stored id is listed under its destination node."""
    with state.lock:
        message_id = _flower_store(state, message)
        if message_id is not None:
            ids = _node_index(state).setdefault(message.metadata.dst_node_id, [])
            if message_id not in ids:
                ids.append(message_id)
        return message_id


def get_message_ins(
    state: InMemoryLinkState, node_id: int, limit: int | None, *, run_id: int | None = None
) -> list[Message]:
    """Up to ``limit`` undelivered messages for ``node_id`` (of ``run_id`` if given), oldest first, now marked
    delivered: Flower's answer, looking only at this node's messages."""
    if limit is not None and limit < 1:
        raise AssertionError("`limit` must be >= 1")
    found: list[Message] = []
    with state.lock:
        index = _node_index(state)
        ids = index.get(node_id, [])
        for message_id in list(ids):
            state._check_stored_messages({message_id})  # deletes it when expired or outside the federation
            message = state.message_ins_store.get(message_id)
            if message is None:
                ids.remove(message_id)
                continue
            if (run_id is None or message.metadata.run_id == run_id) and message.metadata.delivered_at == "":
                found.append(message)
                if limit and len(found) == limit:
                    break
        if not ids:
            index.pop(node_id, None)
    delivered_at = now().isoformat()
    for message in found:
        message.metadata.delivered_at = delivered_at
    return found


@cache
def checked_flower() -> bool:
    """Whether the installed Flower is one whose in-memory state this module was checked against, and its
    internals that this module uses import (warns once otherwise)."""
    flower = version("flwr")
    checked = flower in CHECKED_FLOWER and MISSING_INTERNALS is None
    if not checked:
        log(
            WARNING,
            "[alignfl] Flower %s: its simulation keeps its own message lookup (nodes × messages per sweep) "
            "and every node is asked for its partition (checked on %s%s)",
            flower,
            ", ".join(sorted(CHECKED_FLOWER)),
            f"; {MISSING_INTERNALS}" if MISSING_INTERNALS else "",
        )
    return checked


def index_message_lookup() -> bool:
    """Install the indexed lookup on ``InMemoryLinkState`` (once per process); False where the installed Flower
    is not one this was checked against."""
    if not checked_flower():
        return False
    if InMemoryLinkState.get_message_ins is get_message_ins:
        return True
    InMemoryLinkState.store_message_ins = store_message_ins
    InMemoryLinkState.get_message_ins = get_message_ins
    return True


def prepare_simulation(grid: Grid) -> PartitionTable | None:
    """For the grid of Flower's simulation on a checked Flower: install the indexed lookup and return node id ->
    partition id as the simulation registered them. None for any other grid (a deployment's SuperLink is another
    process, and its nodes say their partition themselves)."""
    if MISSING_INTERNALS is not None:
        checked_flower()  # warns
        return None
    if not isinstance(grid, InMemoryGrid) or not index_message_lookup():
        return None
    drop_lost_actors()  # the simulation's clients run on Ray actors
    state = grid.state

    def table() -> dict[int, int]:
        with state.lock:  # the simulation may still be registering nodes
            return {node: partition for partition, node in enumerate(state.nodes)}

    return table
