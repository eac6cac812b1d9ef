"""What alignfl changes in Flower's simulation runtime, where it costs per node: the message lookup of its
in-memory state, and asking every node for its partition.

Flower's simulation loop (``vce_api.add_messages_to_queue``) asks the state for each node's next message every
0.1 s, and ``InMemoryLinkState.get_message_ins`` answers by running its validity check (expiry, federation) on
every stored message in turn until one is for that node: a sweep over the nodes costs nodes × messages in flight,
about 3 µs each. A QUERY to each of 1,000 nodes (how the round runner learns the partitions) makes one sweep take
1.5–3 s while holding the interpreter from the workers, and at 10,000 nodes one sweep takes minutes
(``benchmarks/linkstate_sweep.py``; ``benchmarks/RESULTS.md``).

:func:`index_message_lookup` gives the state a per-node list of message ids, kept by the one method that stores
messages, and answers the lookup from that node's list: the same messages in the same order, marked delivered
the same way, the same check on each, so expired or foreign messages of that node are deleted as before; those
of other nodes are deleted when their own node is asked (every sweep asks every node). It is installed through
:mod:`alignfl.fl_app.patches.seam`: where the installed Flower is not one whose two methods were read and compared, or
a name is not there as read, the state keeps Flower's own lookup and the log says so.

:func:`prepare_simulation` installs it and reads which partition each node holds from the same state: Flower's
simulation registers its nodes in a loop and gives the i-th partition i (``vce_api._register_nodes``), and the
state keeps its nodes in registration order. The round runner then asks one node instead of every node
(:class:`alignfl.core.rounds.nodes.NodeDirectory`, which checks that node's answer against the table).
"""

from __future__ import annotations

import sys
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from alignfl.core.rounds.nodes import PartitionTable
from alignfl.fl_app.patches import seam
from alignfl.fl_app.patches.ray_pool import drop_lost_actors

_STATE = "flwr.server.superlink.linkstate.InMemoryLinkState"
STORE = f"{_STATE}.store_message_ins"
LOOKUP = f"{_STATE}.get_message_ins"
CHECK = f"{_STATE}._check_stored_messages"
GRID = "flwr.superlink.grid.inmemory_grid.InMemoryGrid"
NOW = "flwr.supercore.date.now"
PATCH = seam.Patch(
    lost="Flower's simulation keeps its own message lookup (nodes × messages per sweep) and every node is "
    "asked for its partition",
    needs=(STORE, LOOKUP, CHECK, GRID, NOW),
)
"""Flower's in-memory state (``store_message_ins``, ``get_message_ins``, ``_check_stored_messages``, its
``lock``, ``message_ins_store`` and ``nodes``), the simulation's grid and Flower's clock."""
_INDEX = "_alignfl_message_ids_by_node"
InMemoryLinkState = Any


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
        message_id = seam.get(STORE)(state, message)
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
    delivered_at = seam.get(NOW)().isoformat()
    for message in found:
        message.metadata.delivered_at = delivered_at
    return found


def index_message_lookup() -> bool:
    """Install the indexed lookup on ``InMemoryLinkState`` (once per process); False where it cannot be installed
    here (the seam has warned)."""

    def apply() -> None:
        if seam.replaced(LOOKUP) is not get_message_ins:
            seam.replace(STORE, store_message_ins)
            seam.replace(LOOKUP, get_message_ins)

    return seam.install(PATCH, apply)


def prepare_simulation(grid: Grid) -> PartitionTable | None:
    """For the grid of Flower's simulation: install the indexed lookup and return node id -> partition id as the
    simulation registered them. None for any other grid (a deployment's SuperLink is another process, and its
    nodes say their partition themselves), or where the lookup cannot be installed here."""
    if "flwr.simulation" not in sys.modules or not type(grid).__module__.startswith("flwr."):
        return None  # no Flower simulation here: a deployed ServerApp (nothing is imported to find out), or ours
    if not seam.usable(PATCH.lost, GRID) or not isinstance(grid, seam.get(GRID)) or not index_message_lookup():
        return None  # the seam has said why where it could not look
    drop_lost_actors()  # the simulation's clients run on Ray actors
    state = grid.state

    def table() -> dict[int, int]:
        with state.lock:  # the simulation may still be registering nodes
            return {node: partition for partition, node in enumerate(state.nodes)}

    return table
