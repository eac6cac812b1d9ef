"""One sweep of Flower's simulation loop over its in-memory state: Flower's message lookup against alignfl's index.

Flower's simulation hands messages to its workers from a loop that asks the state, for every node in turn, for
that node's next message (``InMemoryLinkState.get_message_ins(node, limit=1)``), every 0.1 s. This times that
sweep alone, in this process, with ``--messages`` QUERY messages stored for the first nodes (as the round runner's
partition query stores one per node, and a round one per sampled node):

* ``delivering``: the first sweep after the messages were stored (each is found and marked delivered);
* ``in flight``: the next sweep, the messages delivered but not yet answered (what every sweep costs until the
  replies come back and the server pulls them).

Flower's state is built by ``tests/flower_state.py``, the tests' helper that reads Flower's internals to build
what the simulation starts from; the two lookups are swapped through :mod:`alignfl.fl_app.patches.seam`.

    .venv/bin/python benchmarks/linkstate_sweep.py --nodes 1000 10000 --messages 20 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from flwr.app import Message, MessageType, RecordDict

from alignfl.fl_app.inprocess import set_task_identity
from alignfl.fl_app.patches import flower_runtime, seam

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flower_state import simulation_state


def sweep_seconds(nodes: int, messages: int) -> tuple[float, float]:
    """Seconds of the delivering sweep and of the in-flight sweep over ``nodes`` nodes."""
    grid, state, node_ids = simulation_state(nodes)
    list(
        grid.push_messages(
            [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in node_ids[:messages]]
        )
    )
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        delivered = sum(len(state.get_message_ins(node_id=node, limit=1)) for node in node_ids)
        seconds.append(time.perf_counter() - started)
        assert delivered == (messages if len(seconds) == 1 else 0), "the sweep must deliver each message once"
    return seconds[0], seconds[1]


def use_lookup(lookup: str) -> None:
    """Put Flower's own lookup (``flower``) or alignfl's (``indexed``) on Flower's in-memory state, through the
    seam; refuse where the indexed one cannot be installed here (the seam has said why)."""
    if lookup == "flower":
        seam.restore(flower_runtime.STORE)
        seam.restore(flower_runtime.LOOKUP)
    elif not flower_runtime.index_message_lookup():
        raise SystemExit("the indexed lookup cannot be installed on this Flower (see the warning above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--messages", type=int, nargs="+", default=[20, 1000])
    args = parser.parse_args()
    set_task_identity()
    use_lookup("indexed")  # refused here, before the table, where it cannot be installed
    print(
        "| nodes | messages stored | lookup | delivering sweep (s) | in-flight sweep (s) | load (1 min) |\n"
        "|---|---|---|---|---|---|"
    )
    for nodes in args.nodes:
        for messages in (m for m in args.messages if m <= nodes):
            for lookup in ("flower", "indexed"):
                use_lookup(lookup)
                delivering, in_flight = sweep_seconds(nodes, messages)
                print(
                    f"| {nodes} | {messages} | {lookup} | {delivering:.3f} | {in_flight:.3f} | "
                    f"{os.getloadavg()[0]:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
