"""The layer-wise schedule of a matched-averaging cycle over a permutation description: which entries each stage
completes, which a client leaves unchanged while it retrains, and the output layer's per-class average.

Wang, Yurochkin, Sun, Papailiopoulos and Khazaeni, "Federated Learning with Matched Averaging", ICLR 2020:
a cycle matches one group per stage (spec order, input side first), the clients freezing what is matched, then
averages the output layer row by row with the clients' class counts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from alignfl.models import PermutationSpec


def completion_plan(spec: PermutationSpec, keys: Iterable[str], head: Collection[str]) -> list[frozenset[str]]:
    """The entries completed at each stage ``0 .. G``.

    Stage ``s < G``: entries outside the output layer ``head`` whose groups all lie among the first ``s + 1``.
    Stage ``G``: the rest (the output layer and any entry no group touches).
    """
    groups = list(spec.groups)
    touched = {key: {name for name, _ in refs} for key, refs in spec.axes_by_key().items()}
    remaining = set(keys)
    plan = []
    for stage in range(len(groups)):
        matched = set(groups[: stage + 1])
        done = {k for k in remaining if k not in head and k in touched and touched[k] <= matched}
        plan.append(frozenset(done))
        remaining -= done
    plan.append(frozenset(remaining))
    return plan


def frozen_at(spec: PermutationSpec, keys: Iterable[str], head: Collection[str], stage: int) -> set[str]:
    """The entries a client must leave unchanged while training at ``stage``."""
    return set().union(*completion_plan(spec, keys, head)[:stage])


def class_shares(counts: Tensor, fallback: Tensor) -> Tensor:
    """``K x C``: each of ``K`` clients' share of class ``c``'s examples (``counts``: ``K x C``), its ``fallback``
    share (``K``) for a class no client holds: how FedMA averages the output layer's row of a class."""
    counts = counts.double()
    totals = counts.sum(dim=0)
    return torch.where(totals > 0, counts / totals.clamp(min=1e-300), fallback[:, None])


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
    by_class = class_shares(counts, examples)
    averaged = {}
    for key in keys:
        stacked = torch.stack([state[key].double() for state in states])
        share = by_class if stacked.shape[1:2] == (counts.shape[1],) else examples[:, None]
        share = share.reshape(share.shape + (1,) * (stacked.dim() - 2))
        averaged[key] = (share * stacked).sum(dim=0).to(states[0][key].dtype)
    return averaged
