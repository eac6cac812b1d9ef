"""What client models' units are matched to, one to one: the reference settings that ``matched`` and ``fedma``
borrow under their own keys.

A reference is the round's global model (``global``), one client's model (``client``), the running matched mean
(``iterative``, for several passes of :func:`alignfl.core.merging.alignment.align_and_average`, starting from the global
model or from that client's model) or none: all clients' models matched jointly into one shared unit order
(``universe``, :mod:`alignfl.core.merging.universe`). Declared here, below both algorithms, so that neither imports the
other.

Why a client reference: a client's units keep the imprint of the weights the round started from (the initial
weights are large next to what local SGD adds), so weight matching a trained client onto the round's global model
returns the identity whatever the drift, and so does every later pass of ``iterative`` from there (the first mean is
FedAvg's, which carries the same imprint). Matching clients onto one another is what can reveal that their units
drifted apart. The reference client is the round's client of the lowest partition id whose model has the global
model's shapes: the rule the round runner already follows in round 1 of independent starts
(``client-init=independent``), where no client started from the global model.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignfl.core.merging.universe import UniverseSettings
from alignfl.plugins.options import choice, option, option_from, refuse, source_settings

MATCH_REFERENCES = ("global", "iterative", "universe", "client")
UNIVERSE = "universe"
CLIENT = "client"
STARTS = ("global", CLIENT)


@dataclass(frozen=True)
class Reference:
    """What client units are matched to, one to one: declared once, borrowed under their own keys by ``matched``
    (``matched-reference``, ``matched-iterations``, ``matched-universe-*``) and ``fedma`` (``fedma-reference``,
    ``fedma-iterations``, ``fedma-universe-*``)."""

    reference: str = choice(
        "global",
        "what clients' units are matched to (global: the round's global model; client: the model of the round's "
        "client of the lowest partition id; iterative: the running matched mean; universe: one another, jointly, "
        "in one shared unit order)",
        MATCH_REFERENCES,
    )
    iterations: int = option(3, "passes when the reference is iterative", lambda v: v >= 1, "must be an integer >= 1")
    iterative_start: str = choice(
        "global",
        "what the first pass of the iterative reference aligns onto (global: the round's global model, whose "
        "imprint every client keeps, so the passes may stay the identity; client: as the client reference)",
        STARTS,
    )
    universe_iterations: int = option_from(UniverseSettings, "iterations")
    universe_tolerance: float = option_from(UniverseSettings, "tolerance")

    @property
    def passes(self) -> int:
        """How many times the clients' models are aligned: ``iterations`` with ``iterative``, else once."""
        return self.iterations if self.reference == "iterative" else 1

    @property
    def universe(self) -> bool:
        return self.reference == UNIVERSE

    @property
    def from_client(self) -> bool:
        """Whether the (first) pass aligns onto the reference client's model rather than the global model."""
        return self.reference == CLIENT or (self.reference == "iterative" and self.iterative_start == CLIENT)

    def universe_settings(self) -> UniverseSettings:
        """Frank-Wolfe's settings of the ``universe`` reference
        (:class:`~alignfl.core.merging.universe.UniverseSettings`'s fields)."""
        return source_settings(self, UniverseSettings)


def refuse_universe_cost(reference_key: str, cost_key: str, cost: str) -> None:
    """Universe matching maximises the weight-matching similarity: refuse another cost, naming both keys."""
    if cost != "weight":
        raise refuse(
            reference_key,
            UNIVERSE,
            f"universe matching maximises the weight-matching similarity, so it needs {cost_key}='weight' "
            f"(got {cost_key}={cost!r}); with {cost!r} choose one of {[r for r in MATCH_REFERENCES if r != UNIVERSE]}",
        )
