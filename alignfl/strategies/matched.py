"""Matched averaging: line up every client's hidden units with a reference, then average.

The one-to-one member of the matched-averaging family (Wang et al., "Federated Learning
with Matched Averaging", ICLR 2020). Clients run FedAvg's local SGD. Before averaging,
the server reorders each client model's hidden units (every group of the model's
permutation spec) to best match a reference, solving one assignment problem per group
with :mod:`alignfl.core.merging.alignment`, then averages weighted by examples. PAN encodings never
travel, so nothing here knows whether PANs are on: the matching reads weights only.
With PANs on, moving a unit to another position also gives it another encoding, so the
reordering is no longer function-preserving for that client's model. The combination is
allowed but mostly redundant, as measured in ``benchmarks/RESULTS.md`` ("PANs and
matching: is matching still meaningful with PANs on?", Fashion-MNIST, ``small-mlp``):
models trained one epoch from a common model, as in every round here, have 0-0.2 % of
their units reordered by the matching, PANs on or off, so ``matched`` with PANs behaves
like FedAvg with PANs; and reordering 98 % of a differently initialised model's units
changed its own accuracy by under 0.5 points at the PAN settings tried (mul A = 0.1,
add A = 0.15), so such small encodings bias the matching little. Larger amplitudes would
make a reordered client compute a different function.

Run-config keys:

``matched-cost``
    ``weight`` (weight matching of Ainsworth et al., "Git Re-Basin: Merging Models
    modulo Permutation Symmetries", ICLR 2023) or ``l1`` (Simple-FedMA, from Holm,
    Sajjad and Matjasec, "L46 FedMA Project", project report), see :mod:`alignfl.core.merging.alignment`.
``matched-reference``
    ``global``: align onto the global model the clients started from (one pass).
    Each client's units keep the imprint of that start, so this returns the
    identity whatever the drift (:mod:`alignfl.core.merging.reference`).
    ``client``: align onto the model of the round's client of the lowest
    partition id (one pass), so units that drifted apart between clients can
    be matched; the merge is in that client's unit order.
    ``iterative``: the first pass aligns onto the global model (or, with
    ``matched-iterative-start=client``, onto the ``client`` reference), each
    further pass aligns the clients' models again onto the previous pass's
    matched mean, ``matched-iterations`` passes in all.
    ``universe``: no reference: all the round's client models are matched
    jointly into one shared unit order (Crisostomi et al., "C2M3:
    Cycle-Consistent Multi-Model Merging", NeurIPS 2024; :mod:`alignfl.core.merging.universe`),
    so the maps between any two clients agree with the maps through any third;
    the merge is the example-weighted mean in the first client's unit order
    (partition order). It maximises the weight-matching similarity, so it takes
    ``matched-cost=weight`` only. Each round records the Frank-Wolfe objective
    per iteration (``universe-objective``) and, per group, the cycle-consistency
    error that aligning onto the global model would have had
    (``cycle-consistency-error``: the share of units where a direct pairwise
    matching of two clients disagrees with the composition through the global
    model, averaged over at most :data:`alignfl.core.merging.universe.MAX_PAIRS` pairs, drawn
    at random when the round has more), which costs one weight matching per
    client and one per pair on top of the universe matching.
``matched-iterations``, ``matched-iterative-start``
    Number of passes with ``iterative`` (>= 1), and what its first pass aligns
    onto (``global`` or ``client``); unused otherwise.
``matched-universe-iterations``, ``matched-universe-tolerance``
    With ``universe``: Frank-Wolfe's iteration cap, and the relative
    improvement of its objective below which it stops.

With ``repair=on`` the clients' unit statistics follow their units through the matching's permutations, and the
matched average is renormalised by REPAIR (:mod:`alignfl.core.rounds.repair_round`; what the statistics reveal of a
client's data: ``docs/running.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord
from flwr.common.logger import log

from alignfl.core.merging.alignment import align_and_average, list_costs, matching_generator, mean_share, moved_share
from alignfl.core.merging.reference import UNIVERSE, Reference, refuse_universe_cost
from alignfl.core.merging.universe import cycle_consistency_error, universe_diagnostics, universe_merge
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy, states_and_weights
from alignfl.plugins.options import choice, option_from, source_settings
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class MatchSettings:
    matched_cost: str = choice(
        "weight",
        "how the cost of pairing two units is measured (weight: Git Re-Basin weight matching; l1: Simple-FedMA)",
        list_costs,
    )
    matched_reference: str = option_from(Reference, "reference")
    matched_iterations: int = option_from(Reference, "iterations")
    matched_iterative_start: str = option_from(Reference, "iterative_start")
    matched_universe_iterations: int = option_from(Reference, "universe_iterations")
    matched_universe_tolerance: float = option_from(Reference, "universe_tolerance")

    @property
    def reference(self) -> Reference:
        return source_settings(self, Reference)

    @property
    def passes(self) -> int:
        return self.reference.passes

    def check(self) -> None:
        if self.reference.universe:
            refuse_universe_cost("matched-reference", "matched-cost", self.matched_cost)


class Matched(ServerStrategy):
    """FedAvg whose average is taken after aligning every client model onto a reference (module notes)."""

    aligns_to_reference = True
    repairable = True

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.reference = context.config.settings.reference
        universe = ("matched-reference", UNIVERSE) if self.reference.universe else None
        self.spec = context.required_spec("matched", universe)
        self.aligns_onto_client = self.reference.from_client
        self.global_width = self.spec.group_sizes(context.initial_arrays.to_torch_state_dict())
        """Units per permutation group: the merge keeps the global model's widths, so they are the run's."""

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        """The matched average, with the share of units the matching moved per group (mean over clients) and the
        global width per group; with the ``universe`` reference also Frank-Wolfe's objective per iteration and the
        cycle-consistency error of aligning onto ``reference`` (module notes)."""
        started = time.perf_counter()
        states, weights = states_and_weights(replies)
        if self.reference.universe:
            return self._universe(server_round, states, weights, reference, started)
        matched, permutations = align_and_average(
            reference.to_torch_state_dict(),
            states,
            weights,
            self.spec,
            self.settings.matched_cost,
            self.settings.passes,
            matching_generator(self.context.config.seed, server_round),
        )
        moved = moved_share(permutations)
        log(
            INFO,
            "round %d: matched %d client models (%s cost, %d pass(es)) in %.2f s; %.1f %% of units moved",
            server_round,
            len(replies),
            self.settings.matched_cost,
            self.settings.passes,
            time.perf_counter() - started,
            100 * mean_share(moved),
        )
        return Merge(ArrayRecord(matched), permutations, metrics=self._metrics(moved))

    def _universe(
        self, server_round: int, states: list[dict], weights: list[float], reference: ArrayRecord, started: float
    ) -> Merge:
        """The universe merge of the round's clients, with its diagnostics."""
        seed = self.context.config.seed
        merged, match = universe_merge(
            states, weights, self.spec, self.reference.universe_settings(), matching_generator(seed, server_round)
        )
        matched_at = time.perf_counter()
        cycle = cycle_consistency_error(
            reference.to_torch_state_dict(), states, self.spec, generator=matching_generator(seed, server_round)
        )
        moved = moved_share(match.permutations)
        log(
            INFO,
            "round %d: matched %d client models into one universe in %.2f s (%d Frank-Wolfe step(s), objective "
            "%.4g -> %.4g); %.1f %% of units moved; aligning onto the reference would disagree on %.1f %% of "
            "units between client pairs (%.2f s)",
            server_round,
            len(states),
            matched_at - started,
            len(match.objective) - 1,
            match.objective[0],
            match.projected,
            100 * mean_share(moved),
            100 * mean_share(cycle),
            time.perf_counter() - matched_at,
        )
        metrics = {**self._metrics(moved), **universe_diagnostics(match, cycle)}
        return Merge(ArrayRecord(merged), list(match.permutations), metrics=metrics)

    def _metrics(self, moved: dict[str, float]) -> dict[str, Any]:
        return {"units-moved": moved, "global-width": dict(self.global_width)}


STRATEGIES.register(
    Algorithm(
        "matched",
        Matched,
        LocalUpdate,
        "align client units onto a reference or into one universe (matched-cost, matched-reference), then average",
        MatchSettings,
        paper="Wang et al., Federated Learning with Matched Averaging, ICLR 2020; costs: Ainsworth et al., "
        "Git Re-Basin, ICLR 2023 (weight), Holm, Sajjad and Matjasec, L46 FedMA Project, report (l1); universe: "
        "Crisostomi et al., C2M3: Cycle-Consistent Multi-Model Merging, NeurIPS 2024",
        renamed={
            "match-cost": "matched-cost",
            "match-reference": "matched-reference",
            "match-iterations": "matched-iterations",
        },
    )
)
