"""What every algorithm shares: the client's local SGD loop and the server's reply checks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn

from fl_app.training import iterate_batches

if TYPE_CHECKING:
    from fl_app.config import RunConfig

MetricsAggregator = Callable[[list[RecordDict], str], MetricRecord]
NUM_EXAMPLES = "num-examples"


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


def reply_problem(content: RecordDict, reference: ArrayRecord) -> str | None:
    """What is wrong with a training reply, or None: one ArrayRecord that fits the global model, finite
    values, and one MetricRecord with a positive example count."""
    if len(content.array_records) != 1:
        return f"expected one ArrayRecord, got {len(content.array_records)}"
    if len(content.metric_records) != 1:
        return f"expected one MetricRecord, got {len(content.metric_records)}"
    arrays = next(iter(content.array_records.values()))
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        return f"array keys differ from the global model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in reference.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            return f"array '{key}' has shape {tuple(arrays[key].shape)}, expected {tuple(ref.shape)}"
        if not torch.isfinite(torch.from_numpy(arrays[key].numpy())).all():
            return f"array '{key}' holds NaN or infinite values"
    metrics = next(iter(content.metric_records.values()))
    examples = metrics.get(NUM_EXAMPLES)
    if not isinstance(examples, (int, float)) or isinstance(examples, bool) or not examples > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {examples!r}"
    return None


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
    """

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

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        usable = []
        for message in self._in_partition_order(replies):
            problem = None if message.has_error() else reply_problem(message.content, self._reference)
            if problem is None:
                usable.append(message)
            else:
                log(WARNING, "round %d: dropped reply from node %d: %s",
                    server_round, message.metadata.src_node_id, problem)
        if all(message.has_error() for message in usable):
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            return None, None
        return super().aggregate_train(server_round, usable)  # type: ignore[misc]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return super().aggregate_evaluate(server_round, self._in_partition_order(replies))  # type: ignore[misc]


class LocalUpdate:
    """FedAvg's client: ``local-epochs`` of SGD on cross-entropy from the received global model.

    Algorithms subclass it to add loss terms (:meth:`loss`), to prepare from the
    global model (:meth:`begin`) or to keep state across rounds in ``context.state``.
    """

    def __init__(self, config: RunConfig, context: Context) -> None:
        self.config = config
        self.context = context

    def begin(self, model: nn.Module) -> None:
        """Called after the global model is loaded, before the first step."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective of one mini-batch."""
        return nn.functional.cross_entropy(model(x), y)

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
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
        return {"train-loss": total / steps if steps else math.nan}
