"""How far local training carries the clients' hidden units: from the model a round started from, and apart from
one another (``log-units-moved``).

A client's units keep the imprint of the weights they started from, so weight matching a trained client onto the
round's start returns the identity at any drift; two clients can still have drifted apart (a feature that one
client's unit 3 learned, another's unit 7 learned). Matching every client onto one client's model is what shows
that, so each round records both shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from flwr.app import ArrayRecord
from torch import Tensor

from alignfl.core.merging.alignment import Target, get_cost, moved_share
from alignfl.models.permutation import PermutationSpec

MOVED_FROM_START = "client-units-moved"
"""Per group, the share of units weight matching moves when each client is aligned onto the round's start."""
MOVED_BETWEEN = "client-units-moved-between"
"""Per group, the share of units weight matching moves when every other client is aligned onto the round's client
of the lowest partition id."""

StateDict = Mapping[str, Tensor]


def units_moved(reference: StateDict, states: Sequence[StateDict], spec: PermutationSpec) -> dict[str, float]:
    """Per group, the share of units weight matching moves when each state is aligned onto ``reference`` (mean
    over the states)."""
    shared = Target(reference, spec)
    match = get_cost("weight").match
    generator = torch.Generator().manual_seed(0)
    return moved_share([dict(match(shared, state, generator)) for state in states])


def _same_shapes(reference: StateDict, states: Sequence[StateDict]) -> list[StateDict]:
    """The states whose every entry has ``reference``'s shape (FedMA's BBP-MAP may grow a client's layers)."""
    return [s for s in states if all(s[k].shape == v.shape for k, v in reference.items())]


def units_moved_row(
    start: ArrayRecord | None, models: Sequence[ArrayRecord], spec: PermutationSpec
) -> dict[str, dict[str, float]]:
    """A round's units-moved entries: :data:`MOVED_FROM_START` when the clients started from ``start`` (None in
    round 1 of independent starts), and :data:`MOVED_BETWEEN` when two or more clients' models have one shape
    (``models`` in partition order; the first is the one the others are matched onto)."""
    base = {} if start is None else start.to_torch_state_dict()
    # a Psi-Net reply holds only the groups its client trained; the rest is the start's
    states = [{**base, **record.to_torch_state_dict()} for record in models]
    row = {}
    if start is not None and (from_start := _same_shapes(base, states)):
        row[MOVED_FROM_START] = units_moved(base, from_start, spec)
    if between := _same_shapes(states[0], states[1:]) if states else []:
        row[MOVED_BETWEEN] = units_moved(states[0], between, spec)
    return row
