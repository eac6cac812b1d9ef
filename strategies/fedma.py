"""FedMA's layer-wise schedule (Wang et al., 2020) with Hungarian matching instead of BBP-MAP.

One FedMA *cycle* takes ``G + 1`` communication rounds for a model with ``G``
permutation groups (each server round of the run is one communication, so
``num-server-rounds`` counts communications, as in FedMA's "communication
rounds"):

* stage 0: the sampled clients train the whole global model for
  ``local-epochs``; the server matches the first group (spec order, input side
  first) and averages the entries that group completes;
* stage ``s`` (1 <= s < G): each client gets *its own* model back with every
  entry completed so far replaced by the matched global values and its own
  units of the groups matched so far reordered to the global order; it freezes
  those entries, retrains the rest for ``retrain-epochs``, and the server
  matches group ``s``;
* stage ``G``: clients freeze everything but the output layer (``classifier.*``,
  the name every registered model uses) and retrain it for ``retrain-epochs``;
  the server averages it *per class*, row ``c`` weighted by each client's
  number of examples of class ``c`` (clients send their class counts).

An entry is *completed* at the stage of the last group it touches (a hidden
layer's weight is complete once both its input and output groups are matched).
Matching group ``s`` solves one assignment per client with the run's
``match-cost`` score (:mod:`core.alignment`) on the entries whose other
axes are already aligned (incoming weights, bias, normalisation entries),
against the global model the cycle started from (``match-reference=global``) or,
for ``match-iterations`` passes, against the running matched mean
(``iterative``). The model returned after a mid-cycle stage (and evaluated by
the server) holds the matched entries and the plain average of the aligned
rest.

Where this differs from IBM/FedMA:

* **No Bayesian non-parametric matching and no growth.** FedMA solves BBP-MAP
  (a Beta-Bernoulli process posterior, σ = σ0 = 1, γ = 7) that may open new
  global neurons, so its global model can grow wider than the clients'. Here
  every client is matched one-to-one onto a reference of the same width, so
  the global model keeps the architecture.
* **Any permutation spec.** The stages follow the model's permutation groups,
  so residual networks and the transformer run too (FedMA supports plain conv/FC
  stacks only). A shared group is frozen as a whole: e.g. ResNet's ``stream.0``
  completes the BatchNorm entries ``bn2`` of every stage-1 block at stage 0,
  although the convolutions feeding them are matched later.
* Every cycle starts from the current global model; the first FedMA round
  matches clients trained from one shared initialisation.
* Frozen entries include buffers (BatchNorm running statistics): the client
  restores them after retraining.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from torch import Tensor, nn

from fl_app.config import RunConfig
from core.data import dataset_info
from core.model_io import federated_state
from models import PermutationSpec, permute_state
from core.alignment import get_cost, solve_group, weighted_average
from strategies.base import MODEL_RECORD, LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.matched import reply_weights, run_permutation_spec
from strategies.registry import StrategyEntry, register_strategy

OUTPUT_LAYER = "classifier."
STAGE = "fedma-stage"
CLASS_COUNTS = "class-counts"
"""The extra reply record: ``{"counts": int64 tensor of length num_classes}``."""


def completion_plan(spec: PermutationSpec, keys: Iterable[str]) -> list[frozenset[str]]:
    """The entries completed at each stage ``0 .. G``.

    Stage ``s < G``: entries outside the output layer whose groups all lie among
    the first ``s + 1``. Stage ``G``: the rest (the output layer and any entry
    no group touches).
    """
    groups = list(spec.groups)
    touched = {key: {name for name, _ in refs} for key, refs in spec.axes_by_key().items()}
    remaining = set(keys)
    plan = []
    for stage in range(len(groups)):
        matched = set(groups[: stage + 1])
        done = {k for k in remaining if not k.startswith(OUTPUT_LAYER) and k in touched and touched[k] <= matched}
        plan.append(frozenset(done))
        remaining -= done
    plan.append(frozenset(remaining))
    return plan


def frozen_at(spec: PermutationSpec, keys: Iterable[str], stage: int) -> set[str]:
    """The entries a client must leave unchanged while training at ``stage``."""
    return set().union(*completion_plan(spec, keys)[:stage])


def per_class_average(
    states: Sequence[Mapping[str, Tensor]], counts: Tensor, weights: Sequence[float], keys: Collection[str]
) -> dict[str, Tensor]:
    """Average ``keys`` with row ``c`` (axis 0) weighted by each client's count of class ``c``.

    A class no client holds falls back to the example weights. ``counts`` is
    ``K x C`` for ``K`` states; an entry whose axis 0 is not ``C`` long is
    averaged with the example weights.
    """
    examples = torch.tensor(weights, dtype=torch.float64)
    examples = examples / examples.sum()
    counts = counts.double()
    totals = counts.sum(dim=0)
    by_class = torch.where(totals > 0, counts / totals.clamp(min=1), examples[:, None])
    averaged = {}
    for key in keys:
        stacked = torch.stack([state[key].double() for state in states])
        share = by_class if stacked.shape[1:2] == (counts.shape[1],) else examples[:, None]
        share = share.reshape(share.shape + (1,) * (stacked.dim() - 2))
        averaged[key] = (share * stacked).sum(dim=0).to(states[0][key].dtype)
    return averaged


class FedMA(StrategyBase, FlowerFedAvg):
    """The layer-wise FedMA schedule (see the module notes); one stage per server round.

    Parameters
    ----------
    spec : PermutationSpec
        The model's permutation groups; their order is the matching order.
    cost : str
        Name of the alignment cost whose score matches one group.
    passes : int
        1 to match onto the cycle's starting global model; more to iterate
        against the running matched mean.
    num_classes : int
        Length of the class counts clients send.
    **kwargs
        Flower FedAvg's arguments.
    """

    extra_reply_arrays = (CLASS_COUNTS,)
    state_keys = frozenset({"stage", "cycle-start", "client-models"})

    def __init__(self, spec: PermutationSpec, cost: str, passes: int, num_classes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.score = get_cost(cost).score
        self.cost = cost
        self.passes = passes
        self.num_classes = num_classes
        self.groups = list(spec.groups)
        self.stage = 0
        self.cycle_start: dict[str, Tensor] = {}
        self.client_models: dict[int, dict[str, Tensor]] = {}  # node id → its aligned model, this cycle
        self._restored_models: dict[int, dict[str, Tensor]] = {}  # partition id → model, from a checkpoint

    def summary(self) -> None:
        log(INFO, "\t├──> FedMA: %d groups + output layer per cycle, cost '%s', %d pass(es)",
            len(self.groups), self.cost, self.passes)
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config[STAGE] = self.stage
        if self.stage == 0:
            self.cycle_start = arrays.to_torch_state_dict()
            return super().configure_train(server_round, arrays, config, grid)
        # Later stages go to the cycle's clients only, each with its own partly matched model.
        self._reference = arrays
        config["server-round"] = server_round
        self._place_restored_models(grid)
        return [Message(RecordDict({MODEL_RECORD: ArrayRecord(state), "config": config}),
                        dst_node_id=node, message_type=MessageType.TRAIN)
                for node, state in self.client_models.items()]

    def _place_restored_models(self, grid: Grid) -> None:
        """After a resume, give the cycle's client models (kept by partition) to the nodes now holding those
        partitions; a partition no connected node holds leaves the cycle, as a client that fails would."""
        if not self._restored_models:
            return
        nodes = self.nodes_by_partition(grid)
        missing = sorted(set(self._restored_models) - set(nodes))
        if missing:
            log(WARNING, "FedMA resumes stage %d without partitions %s: no connected node holds them",
                self.stage, missing)
        self.client_models = {nodes[p]: state for p, state in self._restored_models.items() if p in nodes}
        self._restored_models = {}

    def state_dict(self) -> dict[str, Any]:
        """The cycle's stage, its starting global model and each client's aligned model (by partition id)."""
        unnamed = [node for node in self.client_models if node not in self.node_partitions]
        if unnamed:
            log(WARNING, "FedMA checkpoint leaves out nodes %s: their partition is unknown", unnamed)
        return {"stage": self.stage, "cycle-start": dict(self.cycle_start),
                "client-models": {**{self.node_partitions[node]: dict(state)
                                     for node, state in self.client_models.items() if node not in unnamed},
                                  **self._restored_models}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        if not 0 <= int(state.get("stage", 0)) <= len(self.groups):
            raise ValueError(f"FedMA state must hold a stage in 0..{len(self.groups)}, got {state.get('stage')!r}")
        self.stage = int(state["stage"])
        self.cycle_start = dict(state["cycle-start"])
        self.client_models = {}
        self._restored_models = {int(p): dict(models) for p, models in state["client-models"].items()}

    def reply_problem(self, content: RecordDict) -> str | None:
        problem = super().reply_problem(content)
        if problem is not None:
            return problem
        counts = content[CLASS_COUNTS].get("counts")
        if counts is None or tuple(counts.shape) != (self.num_classes,) or (counts.numpy() < 0).any():
            return f"'{CLASS_COUNTS}' must hold 'counts': {self.num_classes} non-negative class counts"
        return None

    def aggregate_models(
        self, server_round: int, usable: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # Flower's FedAvg logs the replies and folds their metrics; its plain average is replaced.
        arrays, metrics = super().aggregate_models(server_round, usable)
        if arrays is None:
            self.stage, self.client_models = 0, {}  # a stage without replies ends the cycle
            return arrays, metrics
        replies = [m for m in usable if not m.has_error()]
        nodes = [self.replier(m) for m in replies]
        states = [m.content[MODEL_RECORD].to_torch_state_dict() for m in replies]
        weights = reply_weights(replies, self.weighted_by_key)
        plan = completion_plan(self.spec, states[0])
        started = time.perf_counter()
        if self.stage < len(self.groups):
            merged = self._match_stage(nodes, states, weights, plan[self.stage])
            self.stage += 1
        else:
            counts = torch.stack([torch.from_numpy(m.content[CLASS_COUNTS]["counts"].numpy()) for m in replies])
            merged = {**states[0], **per_class_average(states, counts, weights, plan[-1])}
            self.stage, self.client_models = 0, {}
        log(INFO, "round %d: FedMA stage %s done for %d clients in %.2f s", server_round,
            self.groups[self.stage - 1] if self.stage else "output layer", len(replies), time.perf_counter() - started)
        return ArrayRecord(merged), metrics

    def _match_stage(
        self, nodes: list[int], states: list[dict[str, Tensor]], weights: list[float], completed: frozenset[str]
    ) -> dict[str, Tensor]:
        """Match the current group, keep each client's aligned model for the next stage, return the global."""
        group = self.groups[self.stage]
        sizes = self.spec.group_sizes(self.cycle_start)
        solved = {name: torch.arange(sizes[name]) for name in self.groups[: self.stage]}  # already in global order
        target: Mapping[str, Tensor] = self.cycle_start
        for _ in range(self.passes):
            aligned = [permute_state(self.spec, state, {group: solve_group(target, state, self.spec, group, solved,
                                                                           self.score)})
                       for state in states]
            target = weighted_average(aligned, weights)
        self.client_models = {node: {**state, **{key: target[key] for key in completed}}
                              for node, state in zip(nodes, aligned)}
        return dict(target)


class FedMAUpdate(LocalUpdate):
    """Train the entries not yet matched in this cycle; report class counts for the output layer's average."""

    def train(
        self, model: nn.Module, x: Tensor, y: Tensor, generator: torch.Generator, device: torch.device,
    ) -> dict[str, float]:
        stage = int(self.received["config"][STAGE])
        state = federated_state(model)
        frozen = frozen_at(model.permutation_spec(), state, stage)
        kept = {key: state[key].detach().clone() for key in frozen}
        if stage > 0:
            self.config = dataclasses.replace(self.config, local_epochs=self.config.retrain_epochs)
        trainable = [p for name, p in model.named_parameters() if name not in frozen]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        try:
            metrics = super().train(model, x, y, generator, device)
        finally:
            for p in model.parameters():  # the client process reuses this model for the next message
                p.requires_grad_(True)
        model.load_state_dict(kept, strict=False)  # frozen buffers (BatchNorm statistics) too
        self.class_counts = torch.bincount(y.cpu(), minlength=model.classifier.out_features)
        return metrics

    def reply_records(self) -> dict[str, ArrayRecord]:
        return {CLASS_COUNTS: ArrayRecord({"counts": self.class_counts})}


def build_server(config: RunConfig, metrics: MetricAggregation) -> FedMA:
    passes = config.match_iterations if config.match_reference == "iterative" else 1
    return FedMA(run_permutation_spec(config), config.match_cost, passes, dataset_info(config.dataset)[1],
                 **flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("fedma", build_server, FedMAUpdate,
                                "FedMA's layer-wise schedule: match one group per round, freeze, retrain the rest"))
