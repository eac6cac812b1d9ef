"""One round runner for every algorithm: sampling, messages, reply checks, metrics, checkpoints, resume.

An algorithm's server side is a :class:`ServerStrategy`: it may add records to the
training messages (:meth:`ServerStrategy.plan_train`), check the contents of its own
extra reply records (:meth:`ServerStrategy.reply_problem`), and folds the checked
replies into the next global model (:meth:`ServerStrategy.aggregate`, FedAvg's
weighted mean by default). Everything else is the :class:`RoundRunner`'s, the same for
all: who is sampled (a seeded ``random.Random`` of its own), in which order replies are
folded (partition order, since float sums depend on order), which replies are dropped
and why, how metrics are folded, and what a checkpoint keeps.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from core.config import RunConfig
from models import PermutationSpec
from models.protocol import ModelHead

MetricsAggregator = Callable[[list[RecordDict], str], MetricRecord]
NUM_EXAMPLES = "num-examples"
NEW_CLIENT = "new-client"
"""Evaluate-reply metric (1) of a held-out client that scored the global model as a new client."""
MODEL_RECORD = "arrays"
"""The record that carries the model, in both directions (Flower's default ``arrayrecord_key``)."""
METRICS_RECORD = "metrics"
"""The record that carries a reply's metrics."""
REPLY_POLL_S = 0.2
"""Seconds between the server's requests for the replies still missing (see :func:`send_and_receive`)."""
CONFIG_RECORD = "config"
PARTITION_QUERY_TIMEOUT = 120.0
PARTITION_QUERY_S_PER_NODE = 0.05
"""The wait for nodes to say their partition: the fixed part plus this per node asked (Flower's Ray backend answers
about 12-22 ms per node on 2 cores: 10,000 nodes took more than the fixed 120 s alone)."""


@dataclass(frozen=True)
class RunContext:
    """What the ServerApp built, handed to the algorithm's server side so that it never rebuilds or guesses it:
    the run's settings, the initial global arrays, the model's permutation description (None for a model
    without one), its head and, for grouped nets, its group layout."""

    config: RunConfig
    initial_arrays: ArrayRecord
    spec: PermutationSpec | None
    head: ModelHead
    layout: Any = None


@dataclass(frozen=True)
class Participation:
    """Who took part in one training round: sampled, aggregated, and why the others were left out.

    ``dropped`` maps a client (its partition id, or ``node <id>`` when the node never said) to the reason.
    """

    sampled: int
    trained: int
    dropped: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        """The round's ``metrics.jsonl`` entries."""
        return {"clients-sampled": self.sampled, "clients-trained": self.trained,
                "clients-dropped": len(self.dropped), "clients-dropped-reasons": dict(self.dropped)}


@dataclass(frozen=True)
class MetricAggregation:
    """How the server folds client metrics (the run's recorder supplies them so it sees every reply), and
    who hears about each training round's :class:`Participation` and each round's own metrics."""

    train: MetricsAggregator
    evaluate: MetricsAggregator
    participation: Callable[[int, Participation], None] | None = None
    round_metrics: Callable[[int, dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class Reply:
    """A checked training reply: the node and partition it came from, its content, and the weight the server
    gives it (its example count, or 1 with ``server-weighting=uniform``)."""

    node: int
    partition: int | None
    content: RecordDict
    weight: float

    @property
    def arrays(self) -> ArrayRecord:
        return self.content[MODEL_RECORD]


def is_holdout(partition_id: int, num_partitions: int, holdout_clients: int) -> bool:
    """Whether a partition is one of the last ``holdout-clients``: a new client that never trains and is
    scored with the global model (SuPerFed: "new clients use the global model")."""
    return partition_id >= num_partitions - holdout_clients


# --- reply checks -------------------------------------------------------------------------------------------


def arrays_problem(arrays: ArrayRecord, reference: ArrayRecord, name: str = MODEL_RECORD) -> str | None:
    """What is wrong with the ArrayRecord ``name`` measured against ``reference``, or None: the same keys and
    shapes, finite values."""
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        return f"'{name}' keys differ from the global model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in reference.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            return f"array '{key}' of '{name}' has shape {tuple(arrays[key].shape)}, expected {tuple(ref.shape)}"
        if not np.isfinite(arrays[key].numpy()).all():  # numpy's one pass: ~10x torch.isfinite's on CPU
            return f"array '{key}' of '{name}' holds NaN or infinite values"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_record_problem(content: RecordDict) -> str | None:
    """What is wrong with where a reply keeps its metrics, or None: one MetricRecord called ``"metrics"``."""
    if list(content.metric_records) != [METRICS_RECORD]:
        return f"expected one MetricRecord '{METRICS_RECORD}', got {sorted(content.metric_records)}"
    return None


def reply_problem(content: RecordDict, reference: ArrayRecord, extra_arrays: Sequence[str] = ()) -> str | None:
    """What is wrong with a training reply, or None: the ArrayRecord ``"arrays"`` that fits ``reference``,
    exactly the extra ArrayRecords the strategy expects (their contents are the strategy's to check), and one
    MetricRecord ``"metrics"`` with a positive example count."""
    expected = sorted({MODEL_RECORD, *extra_arrays})
    if sorted(content.array_records) != expected:
        return f"expected ArrayRecords {expected}, got {sorted(content.array_records)}"
    problem = metric_record_problem(content) or arrays_problem(content[MODEL_RECORD], reference)
    if problem is not None:
        return problem
    examples = content[METRICS_RECORD].get(NUM_EXAMPLES)
    if not _is_number(examples) or not examples > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {examples!r}"
    return None


def evaluate_reply_problem(content: RecordDict) -> str | None:
    """What is wrong with an evaluate reply, or None: no ArrayRecord, and one MetricRecord ``"metrics"``
    whose example count is a number >= 0 (0: an empty local test split, left out of the means)."""
    if len(content.array_records):
        return f"an evaluate reply carries no ArrayRecord, got {sorted(content.array_records)}"
    problem = metric_record_problem(content)
    if problem is not None:
        return problem
    examples = content[METRICS_RECORD].get(NUM_EXAMPLES)
    if not _is_number(examples) or examples < 0:
        return f"metric '{NUM_EXAMPLES}' must be a number >= 0, got {examples!r}"
    return None


def odd_metric_keys(contents: Sequence[RecordDict]) -> list[str | None]:
    """Per reply, why its metric keys differ from the most common key set (ties: the earliest), or None:
    metrics are folded only over replies that report the same keys."""
    key_sets = [frozenset(content[METRICS_RECORD].keys()) for content in contents]
    if not key_sets:
        return []
    counts = Counter(key_sets)
    common = max(key_sets, key=lambda keys: counts[keys])  # max keeps the first of equal counts
    return [None if keys == common else
            f"metric keys differ from the other replies': extra {sorted(keys - common)[:5]}, "
            f"missing {sorted(common - keys)[:5]}" for keys in key_sets]


def weighted_mean(replies: Sequence[Reply]) -> ArrayRecord:
    """FedAvg: the models weighted by :attr:`Reply.weight` (Flower's own arithmetic, in the order given)."""
    return aggregate_arrayrecords([RecordDict({MODEL_RECORD: r.arrays, METRICS_RECORD: MetricRecord({NUM_EXAMPLES: r.weight})})
                                   for r in replies], NUM_EXAMPLES)


# --- the algorithm's server side ------------------------------------------------------------------------------


class ServerStrategy:
    """An algorithm's server side; as it is, FedAvg (the global model is the example-weighted mean).

    Subclasses override :meth:`aggregate` and, where the algorithm needs them, :meth:`plan_train` (extra
    records, or other recipients), :meth:`reply_problem` (their extra reply records), :meth:`on_empty_round`,
    :meth:`round_metrics`
    and :meth:`state_dict` / :meth:`load_state_dict` (what they carry from round to round, named in
    :attr:`state_keys`). ``context`` is what the ServerApp built; ``settings`` the algorithm's own settings.
    """

    extra_reply_arrays: tuple[str, ...] = ()
    """ArrayRecords a training reply carries beside ``"arrays"`` (e.g. SCAFFOLD's control update)."""
    state_keys: frozenset[str] = frozenset()
    """The entries :meth:`state_dict` may hold (none: the rounds depend only on the global model)."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.settings = context.config.settings

    def describe(self) -> str:
        """One line for the log: the algorithm and its settings."""
        return f"{type(self).__name__} {self.settings}"

    def plan_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                   sample: Callable[[], list[int]], nodes: NodeDirectory) -> dict[int, RecordDict]:
        """Node id → training message content; by default the global model to each sampled node."""
        return {node: RecordDict({MODEL_RECORD: arrays, CONFIG_RECORD: config}) for node in sample()}

    def reply_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        """What is wrong with one training reply, or None; extend it to check the extra records' contents."""
        return reply_problem(content, reference, self.extra_reply_arrays)

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> ArrayRecord | None:
        """The next global model from the checked replies (in partition order), or None to keep ``reference``."""
        return weighted_mean(replies)

    def on_empty_round(self, server_round: int) -> None:
        """Called instead of :meth:`aggregate` when a training round has no usable reply."""

    def round_metrics(self) -> dict[str, Any]:
        """Entries this round adds to ``metrics.jsonl`` (read after :meth:`aggregate`)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the server side carries from one round to the next, as tensors and plain values (a checkpoint
        stores it with ``torch.save`` and loads it with ``weights_only``). Clients are named by partition id."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up what :meth:`state_dict` returned, to resume a run."""
        self.check_state(state)

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint's strategy state with entries this strategy does not keep (:attr:`state_keys`)."""
        unknown = set(state) - self.state_keys
        if unknown:
            kept = f"keeps only {sorted(self.state_keys)}" if self.state_keys else "keeps no server state"
            raise ValueError(f"strategy {type(self).__name__} {kept}, but the checkpoint holds {sorted(unknown)}")


# --- nodes ---------------------------------------------------------------------------------------------------


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
                log(WARNING, "[alignfl] node %d says partition %s, the runtime's partition table %d: asking every "
                    "node instead", witness, self.partitions.get(witness), table[witness])
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
        log(INFO, "[alignfl] asked %d nodes for their partition in %.1f s; %d answered", len(nodes),
            time.monotonic() - started, len(replies))
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
        log(WARNING, "[alignfl] %d of min-available-nodes=%d nodes connected after %.0f s (node-wait-timeout); "
            "starting with them", connected, count, timeout)
    elif last_log:
        log(INFO, "[alignfl] %d nodes connected; starting", connected)
    return connected


# --- the round runner ------------------------------------------------------------------------------------------


class RoundRunner:
    """Runs rounds ``first_round .. num-server-rounds`` of one strategy over a grid.

    * Sampling: ``int(fraction · nodes)`` nodes (at least one) drawn with the runner's own seeded
      ``random.Random`` from the nodes in partition order; its state is part of a checkpoint. Training
      samples only the nodes not held out (``holdout-clients``); evaluation samples all.
    * Clients evaluate the global model every ``evaluate-every`` rounds and in the last one.
    * Nodes: the first round waits up to ``node-wait-timeout`` for ``min-available-nodes``; later rounds use
      whoever is connected, so a node that dies never stalls the run.
    * Replies: an error reply, one that did not come within ``round-timeout``, a malformed one
      (:meth:`ServerStrategy.reply_problem`) or one whose metric keys differ from the others' is dropped and
      logged with its reason; each training round's :class:`Participation` is reported.
    * An aggregate that does not fit the global model (unless the strategy changes the model's shape) or is
      not finite is refused and the global model kept.
    """

    def __init__(self, strategy: ServerStrategy, grid: Grid, metrics: MetricAggregation,
                 partition_table: PartitionTable | None = None) -> None:
        config = strategy.context.config
        self.strategy = strategy
        self.grid = grid
        self.config = config
        self.metrics = metrics
        self.nodes = NodeDirectory(grid, config.holdout_clients, partition_table)
        self.sampling = random.Random(config.seed)

    @property
    def sampling_state(self) -> Any:
        """The state of the client-sampling stream (a checkpoint keeps it)."""
        return self.sampling.getstate()

    @sampling_state.setter
    def sampling_state(self, state: Any) -> None:
        self.sampling.setstate(state)

    def run(self, initial_arrays: ArrayRecord, first_round: int = 1,
            evaluate_fn: Callable[[int, ArrayRecord], Any] | None = None,
            on_round_end: Callable[[int, ArrayRecord], None] | None = None) -> ArrayRecord:
        """Rounds ``first_round .. num-server-rounds``; returns the final global model. Each round trains,
        evaluates on clients, calls ``evaluate_fn(round, arrays)`` then ``on_round_end(round, arrays)``; round
        0 (``evaluate_fn`` on the initial arrays) runs only when ``first_round`` is 1."""
        if first_round < 1:
            raise ValueError(f"first_round = {first_round} must be >= 1")
        last = self.config.num_server_rounds
        log(INFO, "Starting %s, rounds %d to %d", self.strategy.describe(), first_round, last)
        wait_for_nodes(self.grid, self.config.min_available_nodes, self.config.node_wait_timeout)
        arrays = initial_arrays
        if first_round == 1 and evaluate_fn is not None:
            evaluate_fn(0, arrays)
        for server_round in range(first_round, last + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, last)
            arrays = self.train_round(server_round, arrays)
            if server_round % self.config.evaluate_every == 0 or server_round == last:
                self.evaluate_round(server_round, arrays)
            if evaluate_fn is not None:
                evaluate_fn(server_round, arrays)
            if on_round_end is not None:
                on_round_end(server_round, arrays)
        return arrays

    def _sample(self, nodes: list[int], fraction: float) -> list[int]:
        return self.sampling.sample(nodes, max(int(len(nodes) * fraction), 1)) if nodes else []

    def _config(self, server_round: int) -> ConfigRecord:
        return ConfigRecord({**self.config.pan_signature(), "server-round": server_round})

    def _send(self, contents: dict[int, RecordDict], message_type: str) -> tuple[list[Message], dict[str, int]]:
        """Send one message per node and wait for the replies; also returns message id → node, since an
        error the SuperLink makes for a node that went away comes from the SuperLink's own node id."""
        messages = [Message(content, dst_node_id=node, message_type=message_type) for node, content in contents.items()]
        if not messages:
            return [], {}
        replies = send_and_receive(self.grid, messages, self.config.round_timeout)
        return replies, {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}

    def _checked(self, replies: list[Message], destinations: dict[str, int],
                 problem_of: Callable[[RecordDict], str | None], dropped: dict[str, str]) -> list[Reply]:
        """The replies in partition order without errors, malformed contents or odd metric keys; the others'
        reasons go to ``dropped``."""
        well_formed = []
        for message in replies:
            node = destinations.get(message.metadata.reply_to_message_id, message.metadata.src_node_id)
            if message.has_error():
                problem = f"the client failed (error code {message.error.code}): {message.error.reason}"
            else:
                problem = problem_of(message.content)
            if problem is None:
                well_formed.append(Reply(node, self.nodes.partitions.get(node), message.content, self._weight(message)))
            else:
                dropped[self.nodes.name(node)] = problem
        well_formed.sort(key=lambda reply: self.nodes.position(reply.node))
        kept = []
        for reply, problem in zip(well_formed, odd_metric_keys([r.content for r in well_formed]), strict=True):
            if problem is None:
                kept.append(reply)
            else:
                dropped[self.nodes.name(reply.node)] = problem
        return kept

    def _weight(self, message: Message) -> float:
        if self.config.server_weighting == "uniform":
            return 1.0
        return message.content[METRICS_RECORD].get(NUM_EXAMPLES, 0)

    def train_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """One training round; returns the new global model, or ``arrays`` when nothing was aggregated."""
        contents = self.strategy.plan_train(server_round, arrays, self._config(server_round),
                                            lambda: self._sample(self.nodes.trainable(), self.config.fraction_train),
                                            self.nodes)
        log(INFO, "configure_train: %d nodes", len(contents))
        replies, destinations = self._send(contents, MessageType.TRAIN)
        answered = {destinations.get(m.metadata.reply_to_message_id, m.metadata.src_node_id) for m in replies}
        dropped = {self.nodes.name(node): "no reply within the round's timeout"
                   for node in contents if node not in answered}
        usable = self._checked(replies, destinations, lambda c: self.strategy.reply_problem(c, arrays), dropped)
        for client, reason in dropped.items():
            log(WARNING, "round %d: dropped client %s: %s", server_round, client, reason)
        if self.metrics.participation is not None:
            self.metrics.participation(server_round, Participation(len(answered | set(contents)), len(usable),
                                                                   dropped))
        if not usable:
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            self.strategy.on_empty_round(server_round)
            return arrays
        self.metrics.train([r.content for r in usable], NUM_EXAMPLES)
        aggregated = self.strategy.aggregate(server_round, usable, arrays)
        if self.metrics.round_metrics is not None:
            self.metrics.round_metrics(server_round, self.strategy.round_metrics())
        if aggregated is None:
            return arrays
        problem = self._aggregate_problem(aggregated, arrays)
        if problem is not None:
            log(WARNING, "round %d: the aggregated model is refused (%s); the global model is unchanged",
                server_round, problem)
            return arrays
        return aggregated

    def _aggregate_problem(self, aggregated: ArrayRecord, arrays: ArrayRecord) -> str | None:
        if getattr(self.strategy, "changes_shapes", False):
            bad = [key for key, a in aggregated.items() if not np.isfinite(a.numpy()).all()]
            return f"arrays {bad[:5]} hold NaN or infinite values" if bad else None
        return arrays_problem(aggregated, arrays, "aggregate")

    def evaluate_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Every sampled node (held-out ones too) scores the global model on its local test split."""
        nodes = self._sample(self.nodes.connected(), self.config.fraction_evaluate)
        content = RecordDict({MODEL_RECORD: arrays, CONFIG_RECORD: self._config(server_round)})
        replies, destinations = self._send(dict.fromkeys(nodes, content), MessageType.EVALUATE)
        dropped: dict[str, str] = {}
        kept = self._checked(replies, destinations, evaluate_reply_problem, dropped)
        for client, reason in dropped.items():
            log(WARNING, "round %d: left out the evaluate reply of client %s: %s", server_round, client, reason)
        if kept:
            self.metrics.evaluate([r.content for r in kept], NUM_EXAMPLES)
