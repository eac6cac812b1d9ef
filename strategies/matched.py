"""Matched averaging: line up every client's hidden units with a reference, then average (FedMA family).

Clients run FedAvg's local SGD. Before averaging, the server reorders each
client model's hidden units (every group of the model's permutation spec) to
best match a reference, solving one assignment problem per group with
:mod:`core.alignment`, then averages weighted by examples
(ALGORITHMS.md §2). PAN encodings never travel, so nothing here knows whether
PANs are on: the matching reads weights only. With PANs on, moving a unit to
another position also gives it another encoding, so the reordering is no
longer function-preserving for that client's model. The combination is
allowed but mostly redundant, as measured in benchmarks/RESULTS.md (issue 4,
Fashion-MNIST, ``small-mlp``): models trained one epoch from a common model, as
in every round here, have 0-0.2 % of their units reordered by the matching,
PANs on or off, so ``matched`` with PANs behaves like FedAvg with PANs; and
reordering 98 % of a differently initialised model's units changed its own
accuracy by under 0.5 points at the PAN settings tried (mul A = 0.1, add
A = 0.15), so such small encodings bias the matching little. Larger
amplitudes would make a reordered client compute a different function.

Run-config keys:

``match-cost``
    ``weight`` (Git Re-Basin weight matching) or ``l1`` (Simple-FedMA), see
    :mod:`core.alignment`.
``match-reference``
    ``global``: align onto the global model the clients started from (one pass).
    ``iterative``: the first pass aligns onto the global model, each further
    pass aligns the clients' models again onto the previous pass's matched
    mean, ``match-iterations`` passes in all.
``match-iterations``
    Number of passes with ``iterative`` (>= 1); unused with ``global``.
"""

from __future__ import annotations

import time
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fl_app.config import RunConfig
from core.data import dataset_info
from models import Permutable, PermutationSpec, build_model
from core.alignment import matched_average
from strategies.base import MODEL_RECORD, LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.registry import StrategyEntry, register_strategy

MATCH_REFERENCES = ("global", "iterative")


def run_permutation_spec(config: RunConfig) -> PermutationSpec:
    """The permutation spec of the run's model, built from the config alone (no data is read)."""
    input_shape, num_classes = dataset_info(config.dataset)
    model = build_model(config.model, input_shape, num_classes, config.pan)
    if not isinstance(model, Permutable):
        raise ValueError(f"model '{config.model}' has no permutation_spec(); strategy '{config.strategy}' "
                         "needs one to match hidden units")
    return model.permutation_spec()


def reply_weights(replies: list[Message], key: str) -> list[float]:
    """Each reply's averaging weight (its example count), read from its one MetricRecord."""
    return [float(next(iter(m.content.metric_records.values()))[key]) for m in replies]


class Matched(StrategyBase, FlowerFedAvg):
    """FedAvg whose average is taken after aligning every client model onto a reference.

    Parameters
    ----------
    spec : PermutationSpec
        The model's permutation groups (from :func:`run_permutation_spec`).
    cost : str
        A name from :func:`core.alignment.list_costs`.
    reference : {"global", "iterative"}
        See the module notes.
    iterations : int
        Passes with ``reference="iterative"``.
    seed : int
        Seeds the per-round order in which the ``weight`` cost visits groups.
    **kwargs
        Flower FedAvg's arguments (:func:`flower_strategy_kwargs`).
    """

    def __init__(self, spec: PermutationSpec, cost: str, reference: str, iterations: int, seed: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if reference not in MATCH_REFERENCES:
            raise ValueError(f"match reference {reference!r} is not one of {list(MATCH_REFERENCES)}")
        self.spec = spec
        self.cost = cost
        self.reference = reference
        self.passes = iterations if reference == "iterative" else 1
        self.seed = seed

    def summary(self) -> None:
        log(INFO, "\t├──> Matching: cost '%s', reference '%s', %d pass(es), %d groups",
            self.cost, self.reference, self.passes, len(self.spec.groups))
        super().summary()

    def aggregate_models(
        self, server_round: int, usable: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # Flower's FedAvg logs the replies and folds their metrics; its plain average is replaced.
        arrays, metrics = super().aggregate_models(server_round, usable)
        if arrays is None:
            return arrays, metrics
        replies = [m for m in usable if not m.has_error()]
        started = time.perf_counter()
        matched = matched_average(
            self._reference.to_torch_state_dict(),
            [m.content[MODEL_RECORD].to_torch_state_dict() for m in replies],
            reply_weights(replies, self.weighted_by_key),
            self.spec,
            self.cost,
            self.passes,
            torch.Generator().manual_seed(self.seed * 10_007 + server_round),
        )
        log(INFO, "round %d: matched %d client models (%s cost, %d pass(es)) in %.2f s",
            server_round, len(replies), self.cost, self.passes, time.perf_counter() - started)
        return ArrayRecord(matched), metrics


def build_server(config: RunConfig, metrics: MetricAggregation) -> Matched:
    return Matched(run_permutation_spec(config), config.match_cost, config.match_reference,
                   config.match_iterations, config.seed, **flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("matched", build_server, LocalUpdate,
                                "align client units onto a reference (match-cost, match-reference), then average"))
