"""What every algorithm shares: the client's local SGD loop and the server's reply checks."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from torch import nn

from core.model_io import to_arrays
from core.calibration import classification_scores
from core.training import iterate_batches

if TYPE_CHECKING:
    from fl_app.config import RunConfig

MetricsAggregator = Callable[[list[RecordDict], str], MetricRecord]
NUM_EXAMPLES = "num-examples"
NEW_CLIENT = "new-client"
"""Evaluate-reply metric (1) of a held-out client that scored the global model as a new client."""
MODEL_RECORD = "arrays"
"""The record that carries the model, in both directions (Flower's default ``arrayrecord_key``)."""
METRICS_RECORD = "metrics"
"""The record that carries a reply's metrics (Flower checks that every reply names it alike)."""


@dataclass(frozen=True)
class Participation:
    """Who took part in one training round: sampled, aggregated, and why the others were left out.

    ``dropped`` maps a client (its partition id, or ``node <id>`` when the node never said) to
    the reason; every sampled client is either trained or dropped.
    """

    sampled: int
    trained: int
    dropped: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        """The round's ``metrics.jsonl`` entries."""
        return {"clients-sampled": self.sampled, "clients-trained": self.trained,
                "clients-dropped": len(self.dropped), "clients-dropped-reasons": dict(self.dropped)}


ParticipationListener = Callable[[int, Participation], None]


@dataclass(frozen=True)
class MetricAggregation:
    """How the server folds client metrics; the run's recorder supplies them so it sees every reply,
    and (``participation``) who was sampled, aggregated or dropped in each training round."""

    train: MetricsAggregator
    evaluate: MetricsAggregator
    participation: ParticipationListener | None = None


def is_holdout(partition_id: int, num_partitions: int, holdout_clients: int) -> bool:
    """Whether a partition is one of the last ``holdout-clients``: a new client that never trains and is
    scored with the global model (SuPerFed: "new clients use the global model")."""
    return partition_id >= num_partitions - holdout_clients


def flower_strategy_kwargs(config: RunConfig, metrics: MetricAggregation) -> dict[str, Any]:
    """Keyword arguments every alignfl strategy takes (Flower's, and StrategyBase's ``participation_fn``),
    filled from the run config."""
    return {
        "participation_fn": metrics.participation,
        "sampling_seed": config.seed,
        "holdout_clients": config.holdout_clients,
        "fraction_train": config.fraction_train,
        "fraction_evaluate": config.fraction_evaluate,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        # training samples only from the nodes not held out (the ServerApp has already waited for all)
        "min_available_nodes": config.min_available_nodes - config.holdout_clients,
        "weighted_by_key": NUM_EXAMPLES,
        "train_metrics_aggr_fn": metrics.train,
        "evaluate_metrics_aggr_fn": metrics.evaluate,
    }


def arrays_problem(arrays: ArrayRecord, reference: ArrayRecord, name: str = MODEL_RECORD) -> str | None:
    """What is wrong with the ArrayRecord ``name`` measured against the global model, or None:
    the same keys and shapes, finite values."""
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        return f"'{name}' keys differ from the global model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in reference.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            return f"array '{key}' of '{name}' has shape {tuple(arrays[key].shape)}, expected {tuple(ref.shape)}"
        if not np.isfinite(arrays[key].numpy()).all():  # numpy's one pass: ~10x torch.isfinite's on CPU
            return f"array '{key}' of '{name}' holds NaN or infinite values"
    return None


def _examples(content: RecordDict) -> Any:
    return content[METRICS_RECORD].get(NUM_EXAMPLES)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_record_problem(content: RecordDict) -> str | None:
    """What is wrong with where a reply keeps its metrics, or None: one MetricRecord called ``"metrics"``."""
    if list(content.metric_records) != [METRICS_RECORD]:
        return f"expected one MetricRecord '{METRICS_RECORD}', got {sorted(content.metric_records)}"
    return None


def reply_problem(content: RecordDict, reference: ArrayRecord, extra_arrays: Sequence[str] = ()) -> str | None:
    """What is wrong with a training reply, or None: the ArrayRecord ``"arrays"`` that fits the global
    model, exactly the extra ArrayRecords the strategy expects (their contents are the strategy's to
    check), and one MetricRecord ``"metrics"`` with a positive example count."""
    expected = sorted({MODEL_RECORD, *extra_arrays})
    if sorted(content.array_records) != expected:
        return f"expected ArrayRecords {expected}, got {sorted(content.array_records)}"
    problem = metric_record_problem(content) or arrays_problem(content[MODEL_RECORD], reference)
    if problem is not None:
        return problem
    if not _is_number(_examples(content)) or not _examples(content) > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {_examples(content)!r}"
    return None


def evaluate_reply_problem(content: RecordDict) -> str | None:
    """What is wrong with an evaluate reply, or None: no ArrayRecord, and one MetricRecord ``"metrics"``
    whose example count is a number >= 0 (0: an empty local test split, left out of the means)."""
    if len(content.array_records):
        return f"an evaluate reply carries no ArrayRecord, got {sorted(content.array_records)}"
    problem = metric_record_problem(content)
    if problem is not None:
        return problem
    if not _is_number(_examples(content)) or _examples(content) < 0:
        return f"metric '{NUM_EXAMPLES}' must be a number >= 0, got {_examples(content)!r}"
    return None


def odd_metric_keys(contents: Sequence[RecordDict]) -> list[str | None]:
    """Per reply, why its metric keys differ from the most common key set (ties: the earliest), or None.
    Flower aggregates metrics only when every reply reports the same keys, and refuses the round otherwise."""
    key_sets = [frozenset(content[METRICS_RECORD].keys()) for content in contents]
    if not key_sets:
        return []
    counts = Counter(key_sets)
    common = max(key_sets, key=lambda keys: counts[keys])  # max keeps the first of equal counts
    return [None if keys == common else
            f"metric keys differ from the other replies': extra {sorted(keys - common)[:5]}, "
            f"missing {sorted(common - keys)[:5]}" for keys in key_sets]


def without_records(message: Message, names: Sequence[str]) -> Message:
    """A shallow copy of a reply whose content lacks the records ``names`` (the reply itself is left as it is)."""
    if message.has_error() or not names:
        return message
    stripped = copy.copy(message)
    stripped.content = RecordDict({key: record for key, record in message.content.items() if key not in names})
    return stripped


class PartitionOrderedGrid:
    """A view of a Grid that lists node ids in partition order.

    Flower samples ``random.sample(node_ids, k)``; node ids are random per run, so
    with Python's ``random`` seeded the same *partitions* are drawn only if the ids
    come in a fixed order. Every other attribute is the wrapped grid's.
    """

    def __init__(self, grid: Grid, partitions: dict[int, int], excluded: frozenset[int] = frozenset()) -> None:
        self._grid = grid
        self._partitions = partitions
        self._excluded = excluded

    def get_node_ids(self) -> list[int]:
        """The connected nodes but the ``excluded`` ones, in partition order."""
        nodes = [node for node in self._grid.get_node_ids() if node not in self._excluded]
        return sorted(nodes, key=lambda node: (self._partitions.get(node, 2**63), node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class StrategyBase:
    """What every alignfl strategy adds to a Flower strategy: reproducible sampling, checked replies,
    client faults survived, and rounds that can resume.

    Put it first among the bases (``class X(StrategyBase, FedAvg)``).

    * Nodes are asked once for their ``partition-id`` (a QUERY message), so that a
      seeded run samples the same clients every time and aggregates their replies
      in the same order (float sums depend on order).
    * The nodes of the last ``holdout-clients`` partitions are never sampled for
      training; they are evaluated like the others, as new clients.
    * Client faults: a training reply that is an error (the ClientApp raised), that
      did not come within the round's timeout, that is malformed (:meth:`reply_problem`)
      or whose metric keys differ from the other replies' is left out of the round and
      logged, naming the client and the reason. The round is aggregated when at least
      ``min_train_nodes`` replies remain; otherwise the global model stays as it was.
      Each round's :class:`Participation` goes to ``participation_fn``. Malformed
      evaluate replies are left out of the evaluation means the same way.
    * Rounds: :meth:`start` runs rounds ``first_round .. num_rounds`` (Flower's always
      starts at 1), so a resumed run sends clients the true round number (their seeds
      depend on it) and every hook sees it; ``on_round_end`` is where the server
      checkpoints. An aggregate that does not fit the global model, or is not finite,
      is refused and the global model kept.
    * Server state: :meth:`state_dict` / :meth:`load_state_dict` carry what a strategy
      keeps from round to round (nothing here; FedAvgM, SCAFFOLD and FedMA extend them).
    * A strategy whose replies carry ArrayRecords beside ``"arrays"`` (SCAFFOLD's
      control update) names them in :attr:`extra_reply_arrays` and checks their
      contents by extending :meth:`reply_problem`. They are taken out before
      Flower's FedAvg aggregation, which would otherwise refuse the reply (it
      expects one ArrayRecord) or average them into the model; the strategy reads
      them from :meth:`usable_replies` and folds them itself.
    """

    extra_reply_arrays: tuple[str, ...] = ()
    state_keys: frozenset[str] = frozenset()
    """The entries :meth:`state_dict` may hold (none: the rounds depend only on the global model)."""

    def __init__(self, *args: Any, participation_fn: ParticipationListener | None = None, sampling_seed: int = 0,
                 holdout_clients: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampling_state = random.Random(sampling_seed).getstate()
        """The state of the random stream that samples clients (see :meth:`_sampling`); a checkpoint keeps it."""
        self.holdout_clients = holdout_clients
        self.holdout_nodes: set[int] = set()  # nodes of held-out partitions: evaluated, never trained
        self.node_partitions: dict[int, int] = {}
        self._reference = ArrayRecord()
        self.participation_fn = participation_fn
        self._sampled: list[int] = []  # the nodes sent this round's training messages (set by start)
        self._destinations: dict[str, int] = {}  # message id -> node, of the messages start sent last

    def _ordered(self, grid: Grid) -> PartitionOrderedGrid:
        """Learn the partition of nodes not seen before, then view the grid in partition order."""
        unknown = [node for node in grid.get_node_ids() if node not in self.node_partitions]
        if unknown:
            queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in unknown]
            for reply in grid.send_and_receive(queries, timeout=120):
                metrics = {} if reply.has_error() else reply.content.get("metrics", {})
                if "partition-id" in metrics:
                    node, partition = reply.metadata.src_node_id, int(metrics["partition-id"])
                    self.node_partitions[node] = partition
                    if is_holdout(partition, int(metrics["num-partitions"]), self.holdout_clients):
                        self.holdout_nodes.add(node)
        return PartitionOrderedGrid(grid, self.node_partitions)

    def training_grid(self, grid: Grid) -> PartitionOrderedGrid:
        """The grid in partition order without the held-out nodes (``holdout-clients``): whom training samples."""
        self._ordered(grid)
        return PartitionOrderedGrid(grid, self.node_partitions, frozenset(self.holdout_nodes))

    def nodes_by_partition(self, grid: Grid) -> dict[int, int]:
        """Partition id → node id of the connected nodes (node ids change when nodes reconnect, partitions
        do not, so state that names clients keys them by partition)."""
        connected = set(self._ordered(grid).get_node_ids())
        return {partition: node for node, partition in self.node_partitions.items() if node in connected}

    def client_name(self, node: int) -> str:
        """How logs and metrics name a client: its partition id, or the node id when it never said."""
        partition = self.node_partitions.get(node)
        return str(partition) if partition is not None else f"node {node}"

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._reference = arrays
        view = self.training_grid(grid)
        with self._sampling():
            return list(super().configure_train(server_round, arrays, config, view))  # type: ignore[misc]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        view = self._ordered(grid)
        with self._sampling():
            return list(super().configure_evaluate(server_round, arrays, config, view))  # type: ignore[misc]

    @contextmanager
    def _sampling(self) -> Iterator[None]:
        """Lend Python's global ``random`` this strategy's sampling stream while Flower samples nodes with it.

        Other code in the server process draws from the global stream at times that depend on the clock
        (Flower's heartbeat thread, Ray's driver), so a seeded global stream alone does not make the
        sampled clients reproducible, nor resumable. The stream is lent only for the sampling itself
        (a thread that draws in that instant, or while Flower waits for missing nodes, would still shift it).
        """
        outer = random.getstate()
        random.setstate(self.sampling_state)
        try:
            yield
        finally:
            self.sampling_state = random.getstate()
            random.setstate(outer)

    def _send(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """Send and wait for the replies, remembering where each message went (see :meth:`replier`)."""
        replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
        self._destinations = {message.metadata.message_id: message.metadata.dst_node_id
                              for message in messages if message.metadata.message_id}
        return replies

    def replier(self, reply: Message) -> int:
        """The node a reply answers for. An error the SuperLink makes for a node that went away (Flower's
        ``NODE_UNAVAILABLE``) comes from the SuperLink's own node id, so it is traced back to the node
        the message was sent to."""
        return self._destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)

    def _in_partition_order(self, replies: Iterable[Message]) -> list[Message]:
        def position(message: Message) -> tuple[int, int]:
            node = self.replier(message)
            return self.node_partitions.get(node, 2**63), node

        return sorted(replies, key=position)

    def reply_problem(self, content: RecordDict) -> str | None:
        """What is wrong with one training reply, or None; extend it to check the extra records' contents."""
        return reply_problem(content, self._reference, self.extra_reply_arrays)

    def _checked(self, replies: list[Message], problem_of: Callable[[RecordDict], str | None],
                 dropped: dict[str, str]) -> list[Message]:
        """The replies without errors, malformed contents or odd metric keys; the others' reasons go to ``dropped``."""
        well_formed = []
        for message in replies:
            if message.has_error():
                problem = f"the client failed (error code {message.error.code}): {message.error.reason}"
            else:
                problem = problem_of(message.content)
            if problem is None:
                well_formed.append(message)
            else:
                dropped[self.client_name(self.replier(message))] = problem
        kept = []
        for message, problem in zip(well_formed, odd_metric_keys([m.content for m in well_formed]), strict=True):
            if problem is None:
                kept.append(message)
            else:
                dropped[self.client_name(self.replier(message))] = problem
        return kept

    def usable_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The training replies to aggregate, in partition order, and the round's participation reported.

        Left out, each logged with its reason: sampled clients that sent nothing in time, error
        replies, malformed ones, and all of them when fewer than ``min_train_nodes`` remain.
        """
        ordered = self._in_partition_order(replies)
        answered = {self.replier(message) for message in ordered}
        dropped = {self.client_name(node): "no reply within the round's timeout"
                   for node in self._sampled if node not in answered}
        usable = self._checked(ordered, self.reply_problem, dropped)
        least = max(1, self.min_train_nodes)  # type: ignore[attr-defined]
        if len(usable) < least:
            for message in usable:
                dropped[self.client_name(self.replier(message))] = (
                    f"round not aggregated: {len(usable)} usable replies, fewer than min-train-nodes={least}")
            usable = []
        for client, reason in dropped.items():
            log(WARNING, "round %d: dropped client %s: %s", server_round, client, reason)
        participation = Participation(len(answered | set(self._sampled)), len(usable), dropped)
        if self.participation_fn is not None:
            self.participation_fn(server_round, participation)
        return usable

    def aggregate_models(
        self, server_round: int, usable: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The Flower strategy's aggregation of checked replies, shown only their model and metrics."""
        if not usable:
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            return None, None
        stripped = [without_records(message, self.extra_reply_arrays) for message in usable]
        return super().aggregate_train(server_round, stripped)  # type: ignore[misc]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.aggregate_models(server_round, self.usable_replies(server_round, replies))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's aggregation over the well-formed evaluate replies, in partition order."""
        dropped: dict[str, str] = {}
        kept = self._checked(self._in_partition_order(replies), evaluate_reply_problem, dropped)
        for client, reason in dropped.items():
            log(WARNING, "round %d: left out the evaluate reply of client %s: %s", server_round, client, reason)
        if not kept:
            return None
        return super().aggregate_evaluate(server_round, kept)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """What the server strategy carries from one round to the next, as tensors and plain values (a
        checkpoint stores it with ``torch.save`` and loads it with ``weights_only``); empty for a strategy
        whose rounds depend only on the global model. Clients are named by partition id, never node id."""
        return {}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint's strategy state with entries this strategy does not keep (:attr:`state_keys`)."""
        unknown = set(state) - self.state_keys
        if unknown:
            kept = f"keeps only {sorted(self.state_keys)}" if self.state_keys else "keeps no server state"
            raise ValueError(f"strategy {type(self).__name__} {kept}, but the checkpoint holds {sorted(unknown)}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up what :meth:`state_dict` returned, to resume a run."""
        self.check_state(state)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        *,
        first_round: int = 1,
        on_round_end: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's round loop over rounds ``first_round .. num_rounds`` (``num_rounds`` is the last round).

        Each round trains (``timeout`` seconds for the replies), evaluates on clients, calls
        ``evaluate_fn``, then ``on_round_end(round, global arrays)``. Round 0 (``evaluate_fn`` on the
        initial arrays) runs only when ``first_round`` is 1. Unlike Flower's, ``Result.arrays`` is
        always the final global model, also when no round aggregated.
        """
        if first_round < 1:
            raise ValueError(f"first_round = {first_round} must be >= 1")
        log(INFO, "Starting %s strategy, rounds %d to %d:", type(self).__name__, first_round, num_rounds)
        self.summary()  # type: ignore[attr-defined]
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        arrays = initial_arrays
        if first_round == 1:
            self._end_round(0, arrays, result, evaluate_fn, None)
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            arrays = self._train_round(server_round, arrays, train_config, grid, timeout, result)
            messages = list(self.configure_evaluate(server_round, arrays, evaluate_config, grid))
            replies = self._send(grid, messages, timeout)
            metrics = self.aggregate_evaluate(server_round, replies)
            if metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = metrics
            self._end_round(server_round, arrays, result, evaluate_fn, on_round_end)
        result.arrays = arrays
        return result

    def _train_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                     timeout: float, result: Result) -> ArrayRecord:
        """One training round; returns the new global model, or ``arrays`` when the round aggregated nothing."""
        messages = list(self.configure_train(server_round, arrays, config, grid))
        self._sampled = [message.metadata.dst_node_id for message in messages]
        replies = self._send(grid, messages, timeout)
        aggregated, metrics = self.aggregate_train(server_round, replies)
        self._sampled = []
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        if aggregated is None:
            return arrays
        problem = arrays_problem(aggregated, arrays, "aggregate")
        if problem is not None:
            log(WARNING, "round %d: the aggregated model is refused (%s); the global model is unchanged",
                server_round, problem)
            return arrays
        return aggregated

    @staticmethod
    def _end_round(server_round: int, arrays: ArrayRecord, result: Result,
                   evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
                   on_round_end: Callable[[int, ArrayRecord], None] | None) -> None:
        if evaluate_fn is not None:
            metrics = evaluate_fn(server_round, arrays)
            if metrics is not None:
                result.evaluate_metrics_serverapp[server_round] = metrics
        if on_round_end is not None:
            on_round_end(server_round, arrays)


class LocalUpdate:
    """FedAvg's client: ``local-epochs`` of SGD on cross-entropy from the received global model.

    Algorithms subclass it to add loss terms (:meth:`loss`), to prepare from the
    global model (:meth:`begin`), to change gradients before each step
    (:meth:`after_backward`), to read what else the server sent (``received``: the
    training message's content, ``"arrays"``, ``"config"`` and any record the
    strategy's server adds), to send more than the model back
    (:meth:`reply_records`) or only part of the model (:meth:`model_record`), or to
    keep state across rounds in ``context.state``.
    """

    def __init__(self, config: RunConfig, context: Context, received: RecordDict | None = None) -> None:
        self.config = config
        self.context = context
        self.received = received if received is not None else RecordDict()

    def begin(self, model: nn.Module) -> None:
        """Called after the global model is loaded, before the first step."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective of one mini-batch."""
        return nn.functional.cross_entropy(model(x), y)

    def after_backward(self, model: nn.Module) -> None:
        """Called once per step, after the backward pass and before the optimizer step."""

    def learning_rate(self) -> float:
        """This round's client learning rate, lr · lr-decay^(round − 1) (SuPerFed's per-round decay); the
        round is the training message's ``server-round``."""
        if self.config.lr_decay == 1.0:
            return self.config.lr
        server_round = self.received["config"].get("server-round") if "config" in self.received else None
        if not isinstance(server_round, int) or server_round < 1:
            raise ValueError(f"lr-decay={self.config.lr_decay} needs the training message's config to hold "
                             f"'server-round' (an integer >= 1), got {server_round!r}")
        return self.config.lr * self.config.lr_decay ** (server_round - 1)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD with this round's learning rate (:meth:`learning_rate`), the run's momentum and weight decay."""
        return torch.optim.SGD(model.parameters(), lr=self.learning_rate(), momentum=self.config.momentum,
                               weight_decay=self.config.weight_decay)

    def train(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator,
        device: torch.device,
    ) -> dict[str, float]:
        """Run the local epochs; returns the mean training loss."""
        self.begin(model)
        optimizer = self.optimizer(model)
        model.train()
        total, steps = 0.0, 0
        for _ in range(self.config.local_epochs):
            for xb, yb in iterate_batches(x, y, self.config.batch_size, generator):
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = self.loss(model, xb, yb)
                loss.backward()
                self.after_backward(model)
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
        return {"train-loss": total / steps if steps else math.nan}

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
        test_y: torch.Tensor, device: torch.device,
    ) -> dict[str, Any]:
        """The client's evaluate reply metrics for the received global ``model``: its loss and accuracy on
        the local test split, with ECE and MCE (15 bins). Personalised algorithms override it to score their
        own models (the training split is there for what they need from it, e.g. a validation part); values
        may be lists of floats."""
        accuracy, ece, mce, loss = classification_scores(model, test_x, test_y, device)
        return {"local-loss": loss, "local-accuracy": accuracy, "local-ece": ece, "local-mce": mce}

    def model_record(self, model: nn.Module) -> ArrayRecord:
        """The model as sent back under ``"arrays"``: its whole federated state (a Ψ-Net client
        overrides this to send only the shared layers and the groups it trained)."""
        return to_arrays(model)

    def reply_records(self) -> dict[str, ArrayRecord]:
        """ArrayRecords to send beside the model's ``"arrays"`` and the metrics; read after :meth:`train`."""
        return {}
