"""FedMA: layer-wise matching by BBP-MAP, so the global model can grow, then freeze and retrain.

Wang, Yurochkin, Sun, Papailiopoulos and Khazaeni, "Federated Learning with Matched
Averaging", ICLR 2020; its BBP-MAP matching is that of Yurochkin et al., "Bayesian
Nonparametric Federated Learning of Neural Networks" (PFNM), ICML 2019.

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
  those entries, retrains the rest for ``fedma-retrain-epochs``, and the server
  matches group ``s``;
* stage ``G``: clients freeze everything but the output layer (the model's head,
  :func:`alignfl.models.protocol.head_of`) and retrain it for ``fedma-retrain-epochs``;
  the server averages it *per class*, row ``c`` weighted by each client's
  number of examples of class ``c`` (clients send their class counts).

An entry is *completed* at the stage of the last group it touches (a hidden
layer's weight is complete once both its input and output groups are matched).
Matching group ``s`` (``fedma-matching``):

* ``bbp`` (the default, FedMA's): BBP-MAP over the clients' units of the group
  (:mod:`alignfl.core.merging.bbp`; ``bbp-sigma``, ``bbp-sigma0``, ``bbp-mu0``, ``bbp-gamma``,
  ``bbp-max-width``, ``bbp-iterations``, ``bbp-include-classifier``, defaults
  as the authors'). A client unit joins a global unit or opens a new one, so
  the matched layer may be wider than the clients'. Each client's model comes
  back with the group's global entries and its own other entries of the group
  (the next layer's inputs) moved onto the global units, zeros for the units
  it lacks (PFNM's patching), so the whole cycle continues at the grown
  width; the global model carries its widths in its arrays' shapes, and
  every model that loads it (clients, the server's evaluation, a resumed run)
  takes them (:func:`alignfl.core.model_io.resize_to`, norms included). A model whose
  permutation description keeps a group at its width (the Ψ-Nets' class
  groups, :attr:`alignfl.models.PermutationSpec.fixed`) is refused with ``bbp``.
* ``weight`` or ``l1``: one assignment per client with that score
  (:mod:`alignfl.core.merging.alignment`) onto the global model the cycle started from
  (``fedma-reference=global``), onto the model of the cycle's first round's
  client of the lowest partition id (``client``), or, for ``fedma-iterations``
  passes, onto the running matched mean (``iterative``, its first pass onto
  the global model or, with ``fedma-iterative-start=client``, onto that
  client's); the width never changes. BBP-MAP has no reference (its global
  units are its own), so ``bbp`` refuses the ``client`` ones.
* ``weight`` with ``fedma-reference=universe``: the stage's group is matched
  jointly over the clients into one shared unit order (Crisostomi et al.,
  "C2M3: Cycle-Consistent Multi-Model Merging", NeurIPS 2024;
  :mod:`alignfl.core.merging.universe`, ``fedma-universe-iterations`` and
  ``fedma-universe-tolerance``), the groups matched at earlier stages held
  fixed (every client holds them in one order already) and the same entries as
  the one-to-one matching taking part; the group's order is the first client's
  (partition order). This fits the stages cleanly: a stage matches one group
  given the earlier ones, whatever it is matched to. Each round also records
  the Frank-Wolfe objective per iteration (``universe-objective``) and the
  cycle-consistency error that matching onto the cycle's starting model would
  have had for the group (``cycle-consistency-error``; that model is carried
  into the clients' order of the earlier groups, one weight matching per
  stage, and is part of the checkpoint). ``bbp`` and ``l1`` are refused with
  ``universe``.

Matching reads the entries whose other axes are already aligned (incoming
weights, bias, normalisation entries; the output layer's weights only with
``bbp-include-classifier``). The model returned after a mid-cycle
stage (and evaluated by the server) holds the matched entries and the
weighted average of the aligned rest. Each round logs the share of units the
stage's matching moved and the global width per group (``units-moved``,
``global-width`` in ``metrics.jsonl``, plotted in ``alignment.png``).

With ``repair=on`` (:mod:`alignfl.core.rounds.repair_round`) each stage renormalises the layers of the group it matched
(the clients' statistics follow their units through the assignment, onto the grown width with BBP-MAP), and the
clients' models of the next stages freeze the repaired entries; the output-layer stage matches no units and is
not repaired.

Where this differs from IBM/FedMA:

* BBP-MAP's own deviations are listed in :mod:`alignfl.core.merging.bbp` (a hard width cap,
  early stop of the sweeps, one ``mu0`` for every coordinate).
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

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, NamedTuple

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log
from torch import Tensor, nn

from alignfl.core.data import ClientData
from alignfl.core.merging.alignment import (
    get_cost,
    list_costs,
    matching_generator,
    moved_share,
    solve_group,
    weighted_average,
)
from alignfl.core.merging.bbp import BBPSettings
from alignfl.core.merging.bbp_model import growth_problem, match_group, patch_clients
from alignfl.core.merging.layerwise import completion_plan, frozen_at, per_class_average
from alignfl.core.merging.reference import CLIENT, UNIVERSE, Reference, refuse_universe_cost
from alignfl.core.merging.repair import assignment_coupling
from alignfl.core.merging.universe import (
    cycle_consistency_error,
    pairwise_matching,
    universe_diagnostics,
    universe_matching,
)
from alignfl.core.model_io import federated_state
from alignfl.core.rounds.nodes import NodeDirectory
from alignfl.core.rounds.replies import CONFIG_RECORD, MODEL_RECORD
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy, states_and_weights
from alignfl.models import permute_state
from alignfl.models.protocol import head_of
from alignfl.plugins.options import choice, option, option_from, refuse, source_settings
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

STAGE = "fedma-stage"
CLASS_COUNTS = "class-counts"
"""The extra reply record: ``{"counts": int64 tensor of length num_classes}``."""


FEDMA_MATCHINGS = ("bbp", *list_costs())
State = dict[str, Tensor]


class StageMerge(NamedTuple):
    """What a stage's matching of one group made: the global model, each client's model aligned to it, how each
    client's units of the group land on the global ones (:attr:`alignfl.core.rounds.strategy.Merge.unit_maps`), and
    the stage's metrics."""

    target: State
    clients: list[State]
    unit_maps: list[dict[str, Tensor]]
    metrics: dict[str, Any]


@dataclass(frozen=True)
class FedMASettings:
    fedma_reference: str = option_from(Reference, "reference")
    fedma_iterations: int = option_from(Reference, "iterations")
    fedma_iterative_start: str = option_from(Reference, "iterative_start")
    fedma_universe_iterations: int = option_from(Reference, "universe_iterations")
    fedma_universe_tolerance: float = option_from(Reference, "universe_tolerance")
    fedma_matching: str = choice(
        "bbp",
        "bbp: FedMA's Bayesian non-parametric matching (the global layer may grow); "
        "weight or l1: one-to-one matching onto the reference (fedma-reference)",
        FEDMA_MATCHINGS,
    )
    fedma_retrain_epochs: int = option(
        1, "local epochs after each layer is matched", lambda v: v >= 1, "must be an integer >= 1"
    )
    bbp_sigma: float = option_from(BBPSettings, "sigma")
    bbp_sigma0: float = option_from(BBPSettings, "sigma0")
    bbp_mu0: float = option_from(BBPSettings, "mu0")
    bbp_gamma: float = option_from(BBPSettings, "gamma")
    bbp_max_width: int = option_from(BBPSettings, "max_width")
    bbp_iterations: int = option_from(BBPSettings, "iterations")
    bbp_include_classifier: bool = option_from(BBPSettings, "include_classifier")

    def bbp(self) -> BBPSettings:
        """BBP-MAP's settings: the ``bbp-*`` fields are :class:`~alignfl.core.merging.bbp.BBPSettings`'s, borrowed."""
        return source_settings(self, BBPSettings)

    @property
    def reference(self) -> Reference:
        return source_settings(self, Reference)

    @property
    def passes(self) -> int:
        """How many times one-to-one matching aligns the clients' units
        (:attr:`alignfl.core.merging.reference.Reference.passes`)."""
        return self.reference.passes

    def check(self) -> None:
        if self.reference.universe:
            refuse_universe_cost("fedma-reference", "fedma-matching", self.fedma_matching)
        if self.reference.from_client and self.fedma_matching == "bbp":
            key = "fedma-reference" if self.fedma_reference == CLIENT else "fedma-iterative-start"
            raise refuse(
                key,
                CLIENT,
                "BBP-MAP (fedma-matching='bbp') matches the clients' units to global units of its own, onto no "
                "reference model; a client reference needs fedma-matching 'weight' or 'l1'",
            )


class FedMA(ServerStrategy):
    """The layer-wise FedMA schedule (see the module notes); one stage per server round."""

    extra_reply_arrays = (CLASS_COUNTS,)
    aligns_to_reference = True
    repairable = True
    state_keys = frozenset({"stage", "cycle-start", "client-models", "universe-reference"})

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.universe = self.settings.reference.universe
        self.aligns_onto_client = self.settings.reference.from_client
        self.spec = context.required_spec("fedma", ("fedma-reference", UNIVERSE) if self.universe else None)
        self.head = frozenset(context.head.keys)
        self.num_classes = context.head.num_classes
        self.bbp = self.settings.fedma_matching == "bbp"
        problem = growth_problem(self.spec) if self.bbp else None
        if problem is not None:
            raise refuse(
                "fedma-matching",
                "bbp",
                f"model {context.config.model!r}: {problem}; with this model use fedma-matching 'weight' or 'l1'",
            )
        self.changes_shapes = self.bbp  # BBP-MAP may open new global units: the round runner allows new widths
        self.score = None if self.bbp else get_cost(self.settings.fedma_matching).score
        self.groups = list(self.spec.groups)
        self.stage = 0
        self.cycle_start: dict[str, Tensor] = {}
        self.client_models: dict[int, dict[str, Tensor]] = {}  # node id → its aligned model, this cycle
        self.client_partitions: dict[int, int | None] = {}  # node id → its partition, this cycle
        self._restored_models: dict[int, dict[str, Tensor]] = {}  # partition id → model, from a checkpoint
        self.universe_reference: dict[str, Tensor] | None = None  # the cycle's start in the clients' unit order

    def describe(self) -> str:
        if self.bbp:
            matching = "BBP-MAP"
        elif self.universe:
            matching = f"'{self.settings.fedma_matching}' into one universe"
        else:
            matching = f"one-to-one '{self.settings.fedma_matching}', {self.settings.passes} pass(es)"
        return f"{super().describe()}: {len(self.groups)} groups + output layer per cycle, {matching}"

    def plan_train(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        sample: Callable[[], list[int]],
        nodes: NodeDirectory,
    ) -> dict[int, RecordDict]:
        config[STAGE] = self.stage
        if self.stage == 0:
            self.cycle_start = arrays.to_torch_state_dict()
            return super().plan_train(server_round, arrays, config, sample, nodes)
        # Later stages go to the cycle's clients only, each with its own partly matched model.
        self._place_restored_models(nodes)
        return {
            node: RecordDict({MODEL_RECORD: ArrayRecord(state), CONFIG_RECORD: config})
            for node, state in self.client_models.items()
        }

    def _place_restored_models(self, nodes: NodeDirectory) -> None:
        """After a resume, give the cycle's client models (kept by partition) to the nodes now holding those
        partitions; a partition no connected node holds leaves the cycle, as a client that fails would."""
        if not self._restored_models:
            return
        by_partition = nodes.by_partition()
        missing = sorted(set(self._restored_models) - set(by_partition))
        if missing:
            log(
                WARNING,
                "FedMA resumes stage %d without partitions %s: no connected node holds them",
                self.stage,
                missing,
            )
        self.client_models = {by_partition[p]: state for p, state in self._restored_models.items() if p in by_partition}
        self.client_partitions = {by_partition[p]: p for p in self._restored_models if p in by_partition}
        self._restored_models = {}

    def state_dict(self) -> dict[str, Any]:
        """The cycle's stage, its starting global model and each client's aligned model (by partition id)."""
        unnamed = [node for node in self.client_models if self.client_partitions.get(node) is None]
        if unnamed:
            log(WARNING, "FedMA checkpoint leaves out nodes %s: their partition is unknown", unnamed)
        universe = {} if self.universe_reference is None else {"universe-reference": dict(self.universe_reference)}
        return {
            **universe,
            "stage": self.stage,
            "cycle-start": dict(self.cycle_start),
            "client-models": {
                **{
                    self.client_partitions[node]: dict(state)
                    for node, state in self.client_models.items()
                    if node not in unnamed
                },
                **self._restored_models,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        if not 0 <= int(state.get("stage", 0)) <= len(self.groups):
            raise ValueError(f"FedMA state must hold a stage in 0..{len(self.groups)}, got {state.get('stage')!r}")
        self.stage = int(state["stage"])
        self.cycle_start = dict(state["cycle-start"])
        reference = state.get("universe-reference")
        self.universe_reference = None if reference is None else dict(reference)
        self.client_models = {}
        self._restored_models = {int(p): dict(models) for p, models in state["client-models"].items()}

    def reply_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        problem = super().reply_problem(content, reference)
        if problem is not None:
            return problem
        counts = content[CLASS_COUNTS].get("counts")
        if counts is None or tuple(counts.shape) != (self.num_classes,) or (counts.numpy() < 0).any():
            return f"'{CLASS_COUNTS}' must hold 'counts': {self.num_classes} non-negative class counts"
        return None

    def on_empty_round(self, server_round: int) -> None:
        """A stage without usable replies ends the cycle."""
        self.stage, self.client_models = 0, {}

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        """The stage's merge, with the share of units its matching moved (mean over clients) and the global width
        per group; with ``fedma-reference=universe`` also the objective and cycle-consistency error (module
        notes)."""
        states, weights = states_and_weights(replies)
        plan = completion_plan(self.spec, states[0], self.head)
        started = time.perf_counter()
        if self.stage == 0:
            self.cycle_start = reference.to_torch_state_dict()  # a client's model when clients started apart
            self.universe_reference = dict(self.cycle_start) if self.universe else None
        if self.stage < len(self.groups):
            match = self._bbp_stage if self.bbp else self._universe_stage if self.universe else self._match_stage
            stage = match(server_round, states, weights)
            merged = stage.target
            self.client_models = {  # each client's aligned model, the entries the stage completed at global values
                reply.node: {**client, **{key: merged[key] for key in plan[self.stage]}}
                for reply, client in zip(replies, stage.clients)
            }
            self.client_partitions = {reply.node: reply.partition for reply in replies}
            unit_maps, groups, metrics = stage.unit_maps, frozenset({self.groups[self.stage]}), stage.metrics
            self.stage += 1
        else:
            counts = torch.stack([torch.from_numpy(r.content[CLASS_COUNTS]["counts"].numpy()) for r in replies])
            merged = {**states[0], **per_class_average(states, counts, weights, plan[-1])}
            self.stage, self.client_models = 0, {}
            unit_maps, groups, metrics = None, frozenset(), {"units-moved": {}}  # the output layer: no unit matched
        widths = self.spec.group_sizes(merged)
        log(
            INFO,
            "round %d: FedMA stage %s done for %d clients in %.2f s; global widths %s",
            server_round,
            self.groups[self.stage - 1] if self.stage else "output layer",
            len(replies),
            time.perf_counter() - started,
            widths,
        )
        return Merge(ArrayRecord(merged), unit_maps, groups, {**metrics, "global-width": widths})

    def _bbp_stage(self, server_round: int, states: list[State], weights: list[float]) -> StageMerge:
        """BBP-MAP of the current group (its layer may grow): the global model, and each client's with the group's
        global entries and its own other entries of the group moved onto the global units (zeros for units it
        lacks), so the next stage's inputs are in global indexing."""
        group = self.groups[self.stage]
        generator = matching_generator(self.context.config.seed, server_round)
        match = match_group(
            states, weights, self.spec, group, self.groups[: self.stage], self.settings.bbp(), generator, head=self.head
        )
        entries, clients = patch_clients(states, self.spec, group, match)
        target = {**weighted_average(clients, weights), **entries}
        moved = moved_share([{group: assignment} for assignment in match.assignments])
        maps = [{group: assignment_coupling(assignment, match.width)} for assignment in match.assignments]
        return StageMerge(target, clients, maps, {"units-moved": moved})

    def _match_stage(self, server_round: int, states: list[State], weights: list[float]) -> StageMerge:
        """One-to-one matching of the current group: the global model and each client's aligned one."""
        group = self.groups[self.stage]
        sizes = self.spec.group_sizes(self.cycle_start)
        solved = {name: torch.arange(sizes[name]) for name in self.groups[: self.stage]}  # already in global order
        target: Mapping[str, Tensor] = self.cycle_start
        for _ in range(self.settings.passes):
            permutations = [
                {group: solve_group(target, state, self.spec, group, solved, self.score)} for state in states
            ]
            aligned = [permute_state(self.spec, state, perms) for state, perms in zip(states, permutations)]
            target = weighted_average(aligned, weights)
        return StageMerge(dict(target), aligned, permutations, {"units-moved": moved_share(permutations)})

    def _universe_stage(self, server_round: int, states: list[State], weights: list[float]) -> StageMerge:
        """The current group matched jointly over the clients (earlier groups fixed): the global model and each
        client's aligned one, with the diagnostics."""
        group, fixed = self.groups[self.stage], self.groups[: self.stage]
        seed = self.context.config.seed
        settings = self.settings.reference.universe_settings()
        match = universe_matching(
            states, self.spec, settings, [group], fixed, generator=matching_generator(seed, server_round)
        )
        aligned = [permute_state(self.spec, state, perms) for state, perms in zip(states, match.permutations)]
        target = weighted_average(aligned, weights)
        cycle: dict[str, float] = {}
        if self.universe_reference is not None:  # None only after resuming a checkpoint that lacks it
            reference = self.universe_reference
            generator = matching_generator(seed, server_round)
            cycle = cycle_consistency_error(reference, states, self.spec, [group], fixed, generator=generator)
            # the group's universe order is the first client's: carry the reference into it for the next stages
            carry = pairwise_matching(states[0], reference, self.spec, [group], fixed, generator)
            self.universe_reference = permute_state(self.spec, reference, carry)
        metrics = {"units-moved": moved_share(match.permutations), **universe_diagnostics(match, cycle)}
        return StageMerge(dict(target), aligned, list(match.permutations), metrics)

    def on_repaired(self, arrays: ArrayRecord) -> None:
        """The next stage's clients freeze the entries the stage just matched completed: at their repaired values
        (also in the client models a resumed run has not yet given to nodes)."""
        repaired = arrays.to_torch_state_dict()
        completed = completion_plan(self.spec, repaired, self.head)[self.stage - 1]
        for state in [*self.client_models.values(), *self._restored_models.values()]:
            state.update({key: repaired[key] for key in completed})


class FedMAUpdate(LocalUpdate):
    """Train the entries not yet matched in this cycle (stage 0: ``local-epochs``, later stages:
    ``fedma-retrain-epochs``); report class counts for the output layer's average. Every client of a stage holds the
    same shapes (BBP-MAP patches them to the global widths) and freezes the same entries, so a stage's clients
    train as one stacked update."""

    def begin(self, model: nn.Module) -> None:
        self.stage = int(self.received[CONFIG_RECORD][STAGE])
        state, head = federated_state(model), head_of(model)
        frozen = frozen_at(model.permutation_spec(), state, head.keys, self.stage)
        self.kept = {key: state[key].detach().clone() for key in frozen}
        self.num_classes = head.num_classes

    def frozen(self, model: nn.Module) -> frozenset[str]:
        return frozenset(name for name, _ in model.named_parameters() if name in self.kept)

    def local_epochs(self) -> int:
        return self.settings.fedma_retrain_epochs if self.stage > 0 else self.config.local_epochs

    def end(self, model: nn.Module, total_loss: float) -> dict[str, float]:
        model.load_state_dict(self.kept, strict=False)  # frozen buffers (BatchNorm statistics) too
        return super().end(model, total_loss)

    def reply_records(self, data: ClientData) -> dict[str, ArrayRecord]:
        counts = torch.bincount(data.train_y.cpu(), minlength=self.num_classes)
        return {CLASS_COUNTS: ArrayRecord({"counts": counts})}


STRATEGIES.register(
    Algorithm(
        "fedma",
        FedMA,
        FedMAUpdate,
        "FedMA's layer-wise schedule: match one group per round (fedma-matching), freeze, retrain the rest",
        FedMASettings,
        paper="Wang et al., Federated Learning with Matched Averaging, ICLR 2020; BBP-MAP: Yurochkin et al., "
        "Bayesian Nonparametric Federated Learning of Neural Networks, ICML 2019",
        renamed={
            "match-reference": "fedma-reference",
            "match-iterations": "fedma-iterations",
            "retrain-epochs": "fedma-retrain-epochs",
        },
    )
)
