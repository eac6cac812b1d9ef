"""The nodes of a grid: which partition each holds, waiting for them, and sending them messages.

Node ids are random per run, partitions are not: :class:`NodeDirectory` lists the nodes
in partition order, so that a seeded run samples and folds the same clients in the same
order every time. The last ``holdout-clients`` partitions are new clients that never
train (:func:`is_holdout`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from alignfl.core.rounds.replies import METRICS_RECORD

REPLY_POLL_S = 0.2
"""Seconds between the server's requests for the replies still missing (see :func:`send_and_receive`)."""
PARTITION_QUERY_TIMEOUT = 120.0
PARTITION_QUERY_S_PER_NODE = 0.05
"""The wait for nodes to say their partition: the fixed part plus this per node asked (Flower's Ray backend answers
about 12-22 ms per node on 2 cores: 10,000 nodes took more than the fixed 120 s alone)."""


def is_holdout(partition_id: int, num_partitions: int, holdout_clients: int) -> bool:
    """Whether a partition is one of the last ``holdout-clients``: a new client that never trains and is
    scored with the global model (SuPerFed: "new clients use the global model")."""
    return partition_id >= num_partitions - holdout_clients


PartitionTable = Callable[[], Mapping[int, int]]
"""Node id -> partition id as the runtime assigned them, for a runtime that knows without asking its nodes (Flower's
simulation gives its i-th registered node partition i); read again whenever unknown nodes appear."""


class NodeDirectory:
    """The nodes of a grid and the partition each holds, listed in partition order: node ids are random per run,
    partitions are not, so a seeded run samples and folds the same clients in the same order every time.

    A node is asked once with a QUERY message. Where the runtime's :data:`PartitionTable` lists a node, only one
    such node is asked (its answer gives ``num-partitions`` and must agree with the table, or the table is
    dropped and every node asked): a query per node costs about 10 ms in Flower's simulation, 10 s at 1,000
    nodes."""

    def __init__(self, grid: Grid, holdout_clients: int, partition_table: PartitionTable | None = None) -> None:
        self.grid = grid
        self.holdout_clients = holdout_clients
        self.partition_table = partition_table
        self.partitions: dict[int, int] = {}
        self.holdouts: set[int] = set()
        self.num_partitions: int | None = None

    def connected(self) -> list[int]:
        """Every connected node, in partition order (nodes that never said last)."""
        self._learn(list(self.grid.get_node_ids()))
        return self._ordered(self.grid.get_node_ids())

    def trainable(self) -> list[int]:
        """The connected nodes but the held-out ones, in partition order."""
        return [node for node in self.connected() if node not in self.holdouts]

    def by_partition(self) -> dict[int, int]:
        """Partition id → node id of the connected nodes."""
        connected = set(self.connected())
        return {partition: node for node, partition in self.partitions.items() if node in connected}

    def name(self, node: int) -> str:
        """How logs and metrics name a client: its partition id, or the node id when it never said."""
        partition = self.partitions.get(node)
        return str(partition) if partition is not None else f"node {node}"

    def position(self, node: int) -> tuple[int, int]:
        return self.partitions.get(node, 2**63), node

    def _ordered(self, nodes: Any) -> list[int]:
        return sorted(nodes, key=self.position)

    def _learn(self, nodes: list[int]) -> None:
        unknown = [node for node in nodes if node not in self.partitions]
        if unknown and self.partition_table is not None:
            self._learn_from_table(unknown)
            unknown = [node for node in unknown if node not in self.partitions]
        if unknown:
            self._ask(unknown)

    def _learn_from_table(self, unknown: list[int]) -> None:
        """The partitions of the unknown nodes the runtime's table lists, after one of them confirmed it."""
        assert self.partition_table is not None
        table = self.partition_table()
        listed = [node for node in unknown if node in table]
        if not listed:
            return
        if self.num_partitions is None:
            witness = listed[0]
            self._ask([witness])
            if self.partitions.get(witness) != table[witness]:
                log(
                    WARNING,
                    "[alignfl] node %d says partition %s, the runtime's partition table %d: asking every node instead",
                    witness,
                    self.partitions.get(witness),
                    table[witness],
                )
                self.partition_table = None
                return
        assert self.num_partitions is not None
        for node in listed:
            self._record(node, table[node], self.num_partitions)
        log(INFO, "[alignfl] %d nodes' partitions from the runtime's partition table", len(listed))

    def _record(self, node: int, partition: int, num_partitions: int) -> None:
        self.partitions[node] = partition
        self.num_partitions = num_partitions
        if is_holdout(partition, num_partitions, self.holdout_clients):
            self.holdouts.add(node)

    def _ask(self, nodes: list[int]) -> None:
        started = time.monotonic()
        queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
        timeout = PARTITION_QUERY_TIMEOUT + PARTITION_QUERY_S_PER_NODE * len(nodes)
        replies = send_and_receive(self.grid, queries, timeout)
        log(
            INFO,
            "[alignfl] asked %d nodes for their partition in %.1f s; %d answered",
            len(nodes),
            time.monotonic() - started,
            len(replies),
        )
        for reply in replies:
            metrics = {} if reply.has_error() else reply.content.get(METRICS_RECORD, {})
            if "partition-id" in metrics:
                self._record(reply.metadata.src_node_id, int(metrics["partition-id"]), int(metrics["num-partitions"]))


def send_and_receive(grid: Grid, messages: list[Message], timeout: float | None) -> list[Message]:
    """Flower's ``Grid.send_and_receive``, asking for replies every :data:`REPLY_POLL_S` seconds: Flower's
    deployed grid asks every 3 s, which leaves a round idle for 1.5 s on average each time it waits for replies.
    Grids that are not Flower's (tests' fakes) are asked to do it themselves."""
    if not isinstance(grid, Grid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    while True:
        arrived = list(grid.pull_messages(pending))
        replies += arrived
        pending -= {reply.metadata.reply_to_message_id for reply in arrived}
        if not pending or time.monotonic() >= deadline:
            return replies
        time.sleep(REPLY_POLL_S)


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> int:
    """Wait up to ``timeout`` seconds until ``count`` nodes are connected; returns how many are. The wait's
    end is logged: a run goes on with the nodes it has."""
    deadline, last_log = time.monotonic() + timeout, 0.0
    while (connected := len(list(grid.get_node_ids()))) < count and time.monotonic() < deadline:
        if time.monotonic() - last_log >= 10.0:
            log(INFO, "[alignfl] waiting for nodes: %d connected, min-available-nodes=%d", connected, count)
            last_log = time.monotonic()
        time.sleep(1.0)
    if connected < count:
        log(
            WARNING,
            "[alignfl] %d of min-available-nodes=%d nodes connected after %.0f s (node-wait-timeout); "
            "starting with them",
            connected,
            count,
            timeout,
        )
    elif last_log:
        log(INFO, "[alignfl] %d nodes connected; starting", connected)
    return connected
