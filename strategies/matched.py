"""Matched averaging: line up every client's hidden units with a reference, then average.

The one-to-one member of the matched-averaging family (Wang et al., "Federated Learning
with Matched Averaging", ICLR 2020). Clients run FedAvg's local SGD. Before averaging,
the server reorders each client model's hidden units (every group of the model's
permutation spec) to best match a reference, solving one assignment problem per group
with :mod:`core.alignment`, then averages weighted by examples. PAN encodings never
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
    Sajjad and Matjasec, "L46 FedMA Project", project report), see :mod:`core.alignment`.
``matched-reference``
    ``global``: align onto the global model the clients started from (one pass).
    ``iterative``: the first pass aligns onto the global model, each further
    pass aligns the clients' models again onto the previous pass's matched
    mean, ``matched-iterations`` passes in all.
``matched-iterations``
    Number of passes with ``iterative`` (>= 1); unused with ``global``.

With ``repair=on`` the clients' unit statistics follow their units through the matching's permutations, and the
matched average is renormalised by REPAIR (:mod:`core.repair_round`; what the statistics reveal of a client's
data: ``docs/running.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord
from flwr.common.logger import log

from core.alignment import align_and_average, list_costs, matching_generator, moved_share
from core.strategy import Reply, RunContext, ServerStrategy, states_and_weights
from models import PermutationSpec
from plugins.options import ConfigError, choice, option, option_from, source_settings
from strategies.base import LocalUpdate
from strategies.registry import STRATEGIES, Algorithm

MATCH_REFERENCES = ("global", "iterative")


@dataclass(frozen=True)
class Reference:
    """What client units are matched to, one to one: declared once, borrowed under their own keys by ``matched``
    (``matched-reference``, ``matched-iterations``) and ``fedma`` (``fedma-reference``, ``fedma-iterations``)."""

    reference: str = choice(
        "global",
        "what clients' units are matched to (global: the round's global model; iterative: the running matched mean)",
        MATCH_REFERENCES,
    )
    iterations: int = option(3, "passes when the reference is iterative", lambda v: v >= 1, "must be an integer >= 1")

    @property
    def passes(self) -> int:
        """How many times the clients' models are aligned: ``iterations`` with ``iterative``, else once."""
        return self.iterations if self.reference == "iterative" else 1


@dataclass(frozen=True)
class MatchSettings:
    matched_cost: str = choice(
        "weight",
        "how the cost of pairing two units is measured (weight: Git Re-Basin weight matching; l1: Simple-FedMA)",
        list_costs,
    )
    matched_reference: str = option_from(Reference, "reference")
    matched_iterations: int = option_from(Reference, "iterations")

    @property
    def passes(self) -> int:
        return source_settings(self, Reference).passes


def permutation_spec(context: RunContext, strategy: str) -> PermutationSpec:
    """The run model's permutation description; refuses a model without one, or one that names entries the
    model's state lacks."""
    if context.spec is None:
        raise ConfigError(
            f"run-config key 'model' = {context.config.model!r} is not allowed with strategy "
            f"'{strategy}': the model has no permutation description to match units with"
        )
    missing = sorted(set(context.spec.axes_by_key()) - set(context.initial_arrays.keys()))
    if missing:
        raise ConfigError(
            f"model {context.config.model!r}: its permutation description names entries the model "
            f"does not have ({missing[:5]}); strategy '{strategy}' cannot match it"
        )
    return context.spec


class Matched(ServerStrategy):
    """FedAvg whose average is taken after aligning every client model onto a reference (module notes)."""

    aligns_to_reference = True
    repairable = True

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.spec = permutation_spec(context, "matched")
        self.moved: dict[str, float] = {}

    def round_metrics(self) -> dict[str, Any]:
        """The share of units the matching moved per group (mean over clients) and the global width per group."""
        sizes = self.spec.group_sizes(self.context.initial_arrays.to_torch_state_dict())
        return {"units-moved": self.moved, "global-width": sizes}

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> ArrayRecord | None:
        started = time.perf_counter()
        matched, permutations = align_and_average(
            reference.to_torch_state_dict(),
            *states_and_weights(replies),
            self.spec,
            self.settings.matched_cost,
            self.settings.passes,
            matching_generator(self.context.config.seed, server_round),
        )
        self.moved = moved_share(permutations)
        self.unit_maps = permutations
        log(
            INFO,
            "round %d: matched %d client models (%s cost, %d pass(es)) in %.2f s; %.1f %% of units moved",
            server_round,
            len(replies),
            self.settings.matched_cost,
            self.settings.passes,
            time.perf_counter() - started,
            100 * sum(self.moved.values()) / max(len(self.moved), 1),
        )
        return ArrayRecord(matched)


STRATEGIES.register(
    Algorithm(
        "matched",
        Matched,
        LocalUpdate,
        "align client units onto a reference (matched-cost, matched-reference), then average",
        MatchSettings,
        paper="Wang et al., Federated Learning with Matched Averaging, ICLR 2020; costs: Ainsworth et al., "
        "Git Re-Basin, ICLR 2023 (weight), Holm, Sajjad and Matjasec, L46 FedMA Project, report (l1)",
        renamed={
            "match-cost": "matched-cost",
            "match-reference": "matched-reference",
            "match-iterations": "matched-iterations",
        },
    )
)
