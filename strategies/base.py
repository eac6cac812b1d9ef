"""What every algorithm shares: the client's local SGD loop and the server's reply checks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
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


class CheckedReplies:
    """Mixin for a Flower strategy: drop malformed training replies, naming node and defect, before aggregation.

    Put it first among the bases (``class X(CheckedReplies, FedAvg)``). A malformed
    reply is left out and logged; if no reply is usable, the global model stays as it was.
    """

    _reference: ArrayRecord

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._reference = arrays
        return super().configure_train(server_round, arrays, config, grid)  # type: ignore[misc]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        usable = []
        for message in replies:
            problem = None if message.has_error() else reply_problem(message.content, self._reference)
            if problem is None:
                usable.append(message)
            else:
                log(WARNING, "round %d: dropped reply from node %d: %s",
                    server_round, message.metadata.src_node_id, problem)
        if not any(not m.has_error() for m in usable):
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            return None, None
        return super().aggregate_train(server_round, usable)  # type: ignore[misc]


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
