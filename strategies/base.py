"""What every algorithm shares: the client's local SGD loop and the server's reply checks."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn

from fl_app.model_io import to_arrays
from fl_app.calibration import classification_scores
from fl_app.training import iterate_batches

if TYPE_CHECKING:
    from fl_app.config import RunConfig

MetricsAggregator = Callable[[list[RecordDict], str], MetricRecord]
NUM_EXAMPLES = "num-examples"
MODEL_RECORD = "arrays"
"""The record that carries the model, in both directions (Flower's default ``arrayrecord_key``)."""


@dataclass(frozen=True)
class MetricAggregation:
    """How the server folds client metrics; the run's recorder supplies both so it sees every reply."""

    train: MetricsAggregator
    evaluate: MetricsAggregator


def flower_strategy_kwargs(config: RunConfig, metrics: MetricAggregation) -> dict[str, Any]:
    """Keyword arguments every Flower strategy takes, filled from the run config."""
    return {
        "fraction_train": config.fraction_train,
        "fraction_evaluate": config.fraction_evaluate,
        "min_train_nodes": 1,
        "min_evaluate_nodes": 1,
        "min_available_nodes": config.min_available_nodes,
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
        if not torch.isfinite(torch.from_numpy(arrays[key].numpy())).all():
            return f"array '{key}' of '{name}' holds NaN or infinite values"
    return None


def reply_problem(content: RecordDict, reference: ArrayRecord, extra_arrays: Sequence[str] = ()) -> str | None:
    """What is wrong with a training reply, or None: the ArrayRecord ``"arrays"`` that fits the global
    model, exactly the extra ArrayRecords the strategy expects (their contents are the strategy's to
    check), and one MetricRecord with a positive example count."""
    expected = sorted({MODEL_RECORD, *extra_arrays})
    if sorted(content.array_records) != expected:
        return f"expected ArrayRecords {expected}, got {sorted(content.array_records)}"
    if len(content.metric_records) != 1:
        return f"expected one MetricRecord, got {len(content.metric_records)}"
    problem = arrays_problem(content[MODEL_RECORD], reference)
    if problem is not None:
        return problem
    metrics = next(iter(content.metric_records.values()))
    examples = metrics.get(NUM_EXAMPLES)
    if not isinstance(examples, (int, float)) or isinstance(examples, bool) or not examples > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {examples!r}"
    return None


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

    def __init__(self, grid: Grid, partitions: dict[int, int]) -> None:
        self._grid = grid
        self._partitions = partitions

    def get_node_ids(self) -> list[int]:
        return sorted(self._grid.get_node_ids(), key=lambda node: (self._partitions.get(node, 2**63), node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class StrategyBase:
    """What every alignfl strategy adds to a Flower strategy: reproducible sampling and checked replies.

    Put it first among the bases (``class X(StrategyBase, FedAvg)``).

    * Nodes are asked once for their ``partition-id`` (a QUERY message), so that a
      seeded run samples the same clients every time and aggregates their replies
      in the same order (float sums depend on order).
    * A malformed training reply is left out and logged, naming node and defect;
      if no reply is usable, the global model stays as it was.
    * A strategy whose replies carry ArrayRecords beside ``"arrays"`` (SCAFFOLD's
      control update) names them in :attr:`extra_reply_arrays` and checks their
      contents by extending :meth:`reply_problem`. They are taken out before
      Flower's FedAvg aggregation, which would otherwise refuse the reply (it
      expects one ArrayRecord) or average them into the model; the strategy reads
      them from :meth:`usable_replies` and folds them itself.
    """

    extra_reply_arrays: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node_partitions: dict[int, int] = {}
        self._reference = ArrayRecord()

    def _ordered(self, grid: Grid) -> PartitionOrderedGrid:
        """Learn the partition of nodes not seen before, then view the grid in partition order."""
        unknown = [node for node in grid.get_node_ids() if node not in self.node_partitions]
        if unknown:
            queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in unknown]
            for reply in grid.send_and_receive(queries, timeout=120):
                if not reply.has_error() and "partition-id" in reply.content.get("metrics", {}):
                    self.node_partitions[reply.metadata.src_node_id] = int(reply.content["metrics"]["partition-id"])
        return PartitionOrderedGrid(grid, self.node_partitions)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._reference = arrays
        return super().configure_train(server_round, arrays, config, self._ordered(grid))  # type: ignore[misc]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return super().configure_evaluate(server_round, arrays, config, self._ordered(grid))  # type: ignore[misc]

    def _in_partition_order(self, replies: Iterable[Message]) -> list[Message]:
        def position(message: Message) -> tuple[int, int]:
            node = message.metadata.src_node_id
            return self.node_partitions.get(node, 2**63), node

        return sorted(replies, key=position)

    def reply_problem(self, content: RecordDict) -> str | None:
        """What is wrong with one training reply, or None; extend it to check the extra records' contents."""
        return reply_problem(content, self._reference, self.extra_reply_arrays)

    def usable_replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies in partition order without the malformed ones, which are logged (error replies
        stay: Flower counts and logs them)."""
        usable = []
        for message in self._in_partition_order(replies):
            problem = None if message.has_error() else self.reply_problem(message.content)
            if problem is None:
                usable.append(message)
            else:
                log(WARNING, "round %d: dropped reply from node %d: %s",
                    server_round, message.metadata.src_node_id, problem)
        return usable

    def aggregate_models(
        self, server_round: int, usable: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The Flower strategy's aggregation of checked replies, shown only their model and metrics."""
        if all(message.has_error() for message in usable):
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            return None, None
        stripped = [without_records(message, self.extra_reply_arrays) for message in usable]
        return super().aggregate_train(server_round, stripped)  # type: ignore[misc]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.aggregate_models(server_round, self.usable_replies(server_round, replies))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return super().aggregate_evaluate(server_round, self._in_partition_order(replies))  # type: ignore[misc]


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

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """SGD with the run's learning rate, momentum and weight decay."""
        return torch.optim.SGD(model.parameters(), lr=self.config.lr, momentum=self.config.momentum,
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
