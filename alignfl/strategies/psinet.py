"""Grouped Ψ-Net averaging: Yu et al., "Fed2: Feature-Aligned Federated Learning", KDD 2021, §4.

Needs a Ψ-Net model (``psi-vgg9``, ``psi-vgg11``: :mod:`alignfl.models.psinet`), whose
state splits into shared keys and per-group keys.

Client: from the labels of its training split it knows which classes, hence which
groups, it holds (Eq. 6). It trims the others: they get no gradient (the loss is
the cross-entropy over the logits of the held groups' classes only, i.e. the
trimmed model's own softmax), the optimizer does not see them (so weight decay and
momentum leave them alone), and they are not sent. The reply carries ``"arrays"``
(shared keys and the held groups' keys) and ``"psi-groups"`` (the held group ids),
which lets the server refuse a reply whose arrays do not match what it declares.

Server: every key is averaged, weighted by examples, over the replies that carry
it. Shared keys (BatchNorm scale, shift and running statistics included) come from
every participant (Eq. 7); group ``g``'s keys (conv, GroupNorm scale and shift,
head) only from the participants holding ``g`` (Eq. 8); a group no participant
holds keeps its previous global value. GroupNorm has no running statistics, so
"GN statistics are not averaged" holds by construction. PAN encodings are not in
the state, so PANs on or off change nothing here.

With ``repair=on`` (:mod:`alignfl.core.rounds.repair_round`) a group's units are renormalised to the statistics of the
clients that trained the group (a trimmed group's statistics are left out), measured on those clients' data; shared
layers on every client's.

Where this differs from the paper, and why:

* Averages are weighted by the clients' example counts, like every strategy here;
  Eqs. 7-8 write a plain mean.
* A trimmed client still computes the trimmed groups' forward pass (their logits
  are then dropped): the result is the same as a physically trimmed net, without a
  second model structure per client; the compute saving the paper mentions is not
  realised.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from torch import nn

from alignfl.core.data import ClientData
from alignfl.core.model_io import arrays_of, federated_state
from alignfl.core.rounds.replies import reply_problem
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy
from alignfl.core.training.sgd import PlainSGD
from alignfl.models.psinet import GroupLayout, held_groups
from alignfl.plugins.options import ConfigError
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

HELD_RECORD = "psi-groups"
"""Reply record naming the groups the client holds (and so trained and sent)."""
HELD_KEY = "held"


class PsiNetUpdate(LocalUpdate):
    """Local SGD on the shared layers and the held groups only (see the module notes)."""

    not_vectorised = "each client trains its own subset of groups and sends only those"

    held: tuple[int, ...] = ()

    def train(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        device: torch.device,
    ) -> dict[str, float]:
        if not isinstance(getattr(model, "layout", lambda: None)(), GroupLayout):
            raise ValueError(f"strategy 'psinet' needs a Ψ-Net model, got {type(model).__name__}")
        self.held = held_groups(model.class_groups, y)
        self._keys = model.layout().keys_for(self.held)
        classes = [c for c, g in enumerate(model.class_groups) if g in self.held]
        remap = torch.full((len(model.class_groups),), -1, dtype=torch.long)
        remap[classes] = torch.arange(len(classes))
        self._classes, self._remap = torch.tensor(classes, device=device), remap.to(device)
        metrics = super().train(model, x, y, generator, device)
        return {**metrics, "groups-held": float(len(self.held))}

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over the held groups' logits: what the trimmed model itself would compute."""
        return nn.functional.cross_entropy(model(x).index_select(1, self._classes), self._remap[y])

    def optimizer(self, model: nn.Module) -> PlainSGD:
        """SGD over the shared and held parameters only."""
        keep = set(self._keys)
        return self.sgd(p for name, p in model.named_parameters() if name in keep)

    def model_record(self, model: nn.Module) -> ArrayRecord:
        state = federated_state(model)
        return arrays_of({key: state[key] for key in self._keys})

    def reply_records(self, data: ClientData) -> dict[str, ArrayRecord]:
        return {HELD_RECORD: ArrayRecord({HELD_KEY: torch.tensor(self.held, dtype=torch.int64)})}


def declared_groups(content: RecordDict, num_groups: int) -> tuple[tuple[int, ...], str | None]:
    """The group ids a reply declares in ``"psi-groups"``, or a description of what is wrong."""
    record = content.array_records.get(HELD_RECORD)
    if record is None or HELD_KEY not in record:
        return (), f"missing ArrayRecord '{HELD_RECORD}' with the held group ids under '{HELD_KEY}'"
    held = record[HELD_KEY].numpy()
    if held.ndim != 1 or held.size == 0 or not np.issubdtype(held.dtype, np.integer):
        return (), f"'{HELD_RECORD}' must be a non-empty 1-D integer array, got {held.dtype} of shape {held.shape}"
    ids = tuple(int(g) for g in held)
    if len(set(ids)) != len(ids) or not all(0 <= g < num_groups for g in ids):
        return (), f"'{HELD_RECORD}' = {list(ids)} must be distinct group ids in 0..{num_groups - 1}"
    return ids, None


def masked_average(reference: ArrayRecord, models: list[ArrayRecord], weights: list[float]) -> ArrayRecord:
    """Every key of ``reference`` averaged (weighted) over the ``models`` that carry it; a key none
    carries keeps its reference value. Sums run in float64, in the order given."""
    averaged: dict[str, Array] = {}
    for key, ref in reference.items():
        carriers = [(m[key].numpy(), w) for m, w in zip(models, weights, strict=True) if key in m]
        if not carriers:
            averaged[key] = ref
            continue
        total = sum(w for _, w in carriers)
        mean = sum(a.astype(np.float64) * (w / total) for a, w in carriers)
        averaged[key] = Array(np.asarray(mean, dtype=ref.numpy().dtype))
    return ArrayRecord(averaged)


class PsiNetStrategy(ServerStrategy):
    """Shared keys averaged over all participants, each group's keys over its holders."""

    extra_reply_arrays = (HELD_RECORD,)
    repairable = True  # nothing moves: a unit is the same unit in every client's model
    ensemble_problem = "its clients send only the shared layers and the groups of the classes they hold"

    def __init__(self, context: RunContext) -> None:
        if not isinstance(context.layout, GroupLayout):
            raise ConfigError(
                f"run-config key 'model' = {context.config.model!r} is not allowed with strategy "
                "'psinet': it needs a Ψ-Net model (one whose state splits into shared and per-group "
                "keys, e.g. psi-vgg9)"
            )
        super().__init__(context)
        self.layout: GroupLayout = context.layout

    def reply_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        """A reply must carry exactly the shared keys and the keys of the groups it declares."""
        held, problem = declared_groups(content, self.layout.num_groups)
        if problem is not None:
            return problem
        expected = ArrayRecord({key: reference[key] for key in self.layout.keys_for(held)})
        return reply_problem(content, expected, self.extra_reply_arrays) or self.repair_statistics_problem(
            content, reference
        )

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        """Each key averaged over the replies that carry it: unit ``i`` of a group is unit ``i`` for every holder,
        so no unit moves."""
        return Merge(masked_average(reference, [r.arrays for r in replies], [r.weight for r in replies]))


STRATEGIES.register(
    Algorithm(
        "psinet",
        PsiNetStrategy,
        PsiNetUpdate,
        "Ψ-Net: shared layers averaged over all, each group over its holders; "
        "clients trim groups they hold no class of",
        paper="Yu et al., Fed2: Feature-Aligned Federated Learning, KDD 2021",
    )
)
