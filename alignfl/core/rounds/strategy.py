"""An algorithm's server side: the hooks the round runner calls, and what they receive.

A :class:`ServerStrategy` may add records to the training messages
(:meth:`ServerStrategy.plan_train`), check the contents of its own extra reply records
(:meth:`ServerStrategy.reply_problem`), and folds the checked replies into the next global
model (:meth:`ServerStrategy.aggregate`, FedAvg's weighted mean by default), returning what it made as a
:class:`Merge`. It is built
from the :class:`RunContext` the ServerApp made (:func:`build_context`); the rounds themselves are
:class:`alignfl.core.rounds.runner.RoundRunner`'s, the same for every algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor, nn

from alignfl.core.config import RunConfig
from alignfl.core.data import dataset_info
from alignfl.core.merging.repair import (
    REPAIR_RECORD,
    RepairError,
    Site,
    find_sites,
    statistics_problem,
    statistics_shapes,
)
from alignfl.core.model_io import array_values, npy_array, to_arrays
from alignfl.core.rounds.nodes import NodeDirectory
from alignfl.core.rounds.replies import CONFIG_RECORD, MODEL_RECORD, reply_problem
from alignfl.core.rounds.sub_models import ClientWidths, first_units
from alignfl.core.widths import refuse_mixed_widths
from alignfl.models import PermutationSpec
from alignfl.models.protocol import ModelHead, head_of
from alignfl.plugins.options import ConfigError, non_negative, option, refuse, settings_fields


@dataclass(frozen=True)
class RunContext:
    """What the ServerApp built, handed to the algorithm's server side so that it never rebuilds or guesses it:
    the run's settings, the initial global arrays, the model's permutation description (None for a model
    without one), its head, for grouped nets its group layout and, with ``repair=on``, the hidden layers REPAIR
    measures and rescales (:mod:`alignfl.core.merging.repair`) or why it cannot."""

    config: RunConfig
    initial_arrays: ArrayRecord
    spec: PermutationSpec | None
    head: ModelHead
    layout: Any = None
    sites: tuple[Site, ...] = ()
    sites_problem: str | None = None

    def required_spec(self, strategy: str, reference: tuple[str, str] | None = None) -> PermutationSpec:
        """The run model's permutation description, for a ``strategy`` that matches units; refuses a model without
        one, or one that names entries the model's state lacks. ``reference``: the run-config key and value of a
        reference that needs the description above all (``universe``), named first in the refusal."""
        model = self.config.model
        if self.spec is None and reference is not None:
            key, value = reference
            raise refuse(
                key,
                value,
                f"it matches all clients' units jointly and needs a model with a permutation description; model "
                f"{model!r} has none (run-config key 'model' = {model!r} is not allowed with strategy '{strategy}')",
            )
        if self.spec is None:
            raise ConfigError(
                f"run-config key 'model' = {model!r} is not allowed with strategy "
                f"'{strategy}': the model has no permutation description to match units with"
            )
        missing = sorted(set(self.spec.axes_by_key()) - set(self.initial_arrays.keys()))
        if missing:
            raise ConfigError(
                f"model {model!r}: its permutation description names entries the model "
                f"does not have ({missing[:5]}); strategy '{strategy}' cannot match it"
            )
        return self.spec


def build_context(config: RunConfig, model: nn.Module) -> RunContext:
    """The run context of ``config`` and its freshly built ``model``: the model's arrays, and what the model
    declares of itself (permutation description, head, group layout), asked of the model, never guessed; with
    ``repair=on`` also its REPAIR sites, found on the model's own forward pass
    (:func:`alignfl.core.merging.repair.find_sites`)."""
    spec = model.permutation_spec() if hasattr(model, "permutation_spec") else None
    layout = model.layout() if hasattr(model, "layout") else None
    sites: tuple[Site, ...] = ()
    problem = None
    if config.repair == "on":
        try:
            if spec is None:
                raise RepairError("it has no permutation description to tell its hidden units by")
            sites = find_sites(model, dataset_info(config.dataset)[0], spec)
        except RepairError as error:
            problem = str(error)
    return RunContext(config, to_arrays(model), spec, head_of(model), layout, sites, problem)


@dataclass(frozen=True)
class Reply:
    """A checked training reply: the node and partition it came from, its content, and the weight the server
    gives it (its example count, or 1 with ``server-weighting=uniform``)."""

    node: int
    partition: int | None
    content: RecordDict
    weight: float

    @property
    def arrays(self) -> ArrayRecord:
        return self.content[MODEL_RECORD]


def offline_replies(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> list[Reply]:
    """Models trained outside a run as the checked training replies of one round (model ``k``: node and partition
    ``k``), for :meth:`ServerStrategy.aggregate`."""
    return [
        Reply(k, k, RecordDict({MODEL_RECORD: ArrayRecord(dict(state))}), float(weight))
        for k, (state, weight) in enumerate(zip(states, weights, strict=True))
    ]


def weighted_mean(replies: Sequence[Reply]) -> ArrayRecord:
    """FedAvg: the models weighted by :attr:`Reply.weight`, summed in the order given with the arithmetic of
    Flower's FedAvg (each array times its share of the total weight, added up)."""
    total = sum(reply.weight for reply in replies)
    sums: dict[str, Any] = {}
    for reply in replies:
        factor = reply.weight / total
        for key, array in reply.arrays.items():
            if key in sums:
                sums[key] += array_values(array) * factor
            else:
                sums[key] = array_values(array) * factor
    return ArrayRecord({key: npy_array(value) for key, value in sums.items()})


@dataclass(frozen=True)
class ServerStep:
    """The server's step towards the clients' weighted mean: declared once, borrowed under their own keys by FedAvgM
    (``fedavgm-server-lr``) and SCAFFOLD (``scaffold-server-lr``)."""

    server_lr: float = option(
        1.0, "step size of the server's update of the global model", non_negative, "must be a finite number >= 0"
    )


@dataclass(frozen=True)
class Merge:
    """What a strategy's :meth:`ServerStrategy.aggregate` made of a round's replies: the next global model, and
    what REPAIR, the round's row and offline tools read of the merge, returned rather than left on the strategy.

    ``unit_maps``: per reply (in the order given), per permutation group, how the reply's units land on the merged
    model's: a permutation (merged unit ``i`` is the reply's unit ``map[i]``) or a coupling (reply units x merged
    units); a group without a map keeps its order (a narrower reply's units are the first ones); None: no reply's
    units moved. ``groups``: the permutation groups whose units this merge merged (FedMA's stage merges one); None:
    every group. ``metrics``: the entries the round adds to ``metrics.jsonl``."""

    arrays: ArrayRecord
    unit_maps: list[dict[str, Tensor]] | None = None
    groups: frozenset[str] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def states_and_weights(replies: Sequence[Reply]) -> tuple[list[dict[str, Tensor]], list[float]]:
    """The replies' models as state dicts and their :attr:`Reply.weight`, in the order given: what an algorithm
    that aligns, fuses or slices the models before averaging them takes."""
    return [reply.arrays.to_torch_state_dict() for reply in replies], [reply.weight for reply in replies]


class ServerStrategy:
    """An algorithm's server side; as it is, FedAvg (the global model is the example-weighted mean).

    Subclasses override :meth:`aggregate` and, where the algorithm needs them, :meth:`plan_train` (extra
    records, or other recipients), :meth:`reply_problem` (their extra reply records, named in
    :attr:`extra_reply_arrays`), :meth:`narrow` (with :attr:`client_widths`), :meth:`on_empty_round`, :meth:`describe`,
    :attr:`changes_shapes` and :meth:`state_dict` / :meth:`load_state_dict` (what they carry from round to
    round, named in :attr:`state_keys`); an algorithm that merges aligned units sets :attr:`repairable` (its
    :class:`Merge` then carries the unit maps and groups REPAIR follows, and :meth:`on_repaired` takes the
    repaired model where it keeps parts of the merge). These are all the round runner and the checkpoint read.
    ``context`` is what the ServerApp built; ``settings`` the algorithm's own settings.
    """

    extra_reply_arrays: tuple[str, ...] = ()
    """ArrayRecords a training reply carries beside ``"arrays"`` (e.g. SCAFFOLD's control update)."""
    state_keys: frozenset[str] = frozenset()
    """The entries :meth:`state_dict` may hold (none: the rounds depend only on the global model)."""
    mixed_widths: bool = False
    """Whether the algorithm takes clients of other widths than the global model's (``client-widths``,
    :mod:`alignfl.core.widths`); the others refuse such a run when they are built."""
    client_widths: ClientWidths | None = None
    """The models of every client width, which such an algorithm builds in ``__init__`` when it takes them:
    training messages then go at each client's width (the global model made that width by :meth:`narrow`) and
    a reply is checked against the model of its width."""
    aligns_to_reference: bool = False
    """Whether :meth:`aggregate` aligns the clients' models onto ``reference`` (matching, OT fusion). In a round
    whose clients share no starting model (``client-init=independent``, round 1) the round runner then hands it
    the first client's model (partition order) instead of a global model no client started from."""
    aligns_onto_client: bool = False
    """Whether :meth:`aggregate` aligns onto one client's model every round (a ``client`` reference) rather than the
    global model: the round runner then hands it the model of the round's client of the lowest partition id whose
    shapes are the global model's, as in round 1 of independent starts."""
    ensemble_problem: str | None = None
    """Why the clients' training replies are not whole models the server can score (``server-ensemble``), or
    None."""
    changes_shapes: bool = False
    """Whether :meth:`aggregate` may return arrays of other shapes than the global model's (FedMA's BBP-MAP
    opens new units): the round runner then checks only that the aggregate is finite, not that it fits."""
    repairable: bool = False
    """Whether :meth:`aggregate` merges the clients' units aligned (matched, fused, or sliced so that unit ``i``
    is unit ``i`` everywhere), so that ``repair=on`` may renormalise the merged units
    (:mod:`alignfl.core.merging.repair`)."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.settings = context.config.settings
        if not self.mixed_widths:
            refuse_mixed_widths(context.config)
        if context.config.log_units_moved and context.spec is None:
            raise refuse(
                "log-units-moved",
                True,
                f"model {context.config.model!r} has no permutation description to match units with",
            )
        if context.config.server_ensemble and self.ensemble_problem is not None:
            raise refuse(
                "server-ensemble",
                True,
                f"strategy '{context.config.strategy}' cannot have its clients' models scored: {self.ensemble_problem}",
            )
        if context.config.repair == "on":
            self._check_repair()
            self.extra_reply_arrays = (*self.extra_reply_arrays, REPAIR_RECORD)

    def _check_repair(self) -> None:
        """Refuse ``repair=on`` for a strategy that does not merge aligned units, or a model whose units REPAIR
        cannot find or rescale (the message names the layer)."""
        config = self.context.config
        if not self.repairable:
            raise refuse(
                "repair",
                "on",
                f"strategy '{config.strategy}' does not align the clients' units before merging them, so there is "
                "no aligned merge to repair; use repair=off, or a strategy that aligns",
            )
        if self.context.sites_problem is not None:
            raise refuse("repair", "on", f"model {config.model!r}: {self.context.sites_problem}")

    def describe(self) -> str:
        """One line for the log: the algorithm's registered name and its settings as run-config keys."""
        values = [f"{s.key}={getattr(self.settings, s.name)!r}" for s in settings_fields(type(self.settings))]
        return f"{self.context.config.strategy} ({', '.join(values) or 'no settings of its own'})"

    def plan_train(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        sample: Callable[[], list[int]],
        nodes: NodeDirectory,
    ) -> dict[int, RecordDict]:
        """Node id → training message content; by default the global model to each sampled node, at the node's
        width with :attr:`client_widths`."""
        if self.client_widths is not None:
            return self.client_widths.plan_train(arrays, config, sample(), nodes, self.narrow)
        return {node: RecordDict({MODEL_RECORD: arrays, CONFIG_RECORD: config}) for node in sample()}

    def reply_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        """What is wrong with one training reply, or None; extend it to check the extra records' contents."""
        if self.client_widths is not None:
            problem = self.client_widths.reply_problem(content, self.extra_reply_arrays)
        else:
            problem = reply_problem(content, reference, self.extra_reply_arrays)
        return problem or self.repair_statistics_problem(content, reference)

    def repair_statistics_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        """With ``repair=on``, what is wrong with a training reply's unit statistics (:data:`REPAIR_RECORD`), or
        None: one mean and one std per unit of every site, at the widths of the reply's model (of ``reference``
        for the layers the reply leaves out), finite, no std below 0."""
        if self.context.config.repair != "on" or REPAIR_RECORD not in content.array_records:
            return None
        shapes = {key: tuple(array.shape) for key, array in reference.items()}
        shapes.update({key: tuple(array.shape) for key, array in content[MODEL_RECORD].items()})
        try:
            statistics = content[REPAIR_RECORD].to_torch_state_dict()
        except (ValueError, TypeError) as error:
            return f"'{REPAIR_RECORD}' cannot be read: {error}"
        return statistics_problem(statistics, statistics_shapes(self.context.sites, shapes))

    def on_repaired(self, arrays: ArrayRecord) -> None:
        """Called with the global model REPAIR made of :meth:`aggregate`'s (``repair=on``), before the round ends:
        a strategy that keeps parts of the aggregate for its next round takes the repaired values here."""

    def narrow(self, state: dict[str, Tensor], template: dict[str, Tensor]) -> dict[str, Tensor]:
        """The global model's ``state`` at the shapes ``template`` of a client of another width (with
        :attr:`client_widths`); by default its first units (HeteroFL's sub-model)."""
        return first_units(state, template)

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge | None:
        """The merge of the checked replies (in partition order) into the next global model, or None to keep
        ``reference``. The round runner calls it, and so do the offline tools that merge models trained outside a
        run (:func:`offline_replies`), so that a merge is written once."""
        return Merge(weighted_mean(replies))

    def on_empty_round(self, server_round: int) -> None:
        """Called instead of :meth:`aggregate` when a training round has no usable reply."""

    def state_dict(self) -> dict[str, Any]:
        """What the server side carries from one round to the next, as tensors and plain values (a checkpoint
        stores it with ``torch.save`` and loads it with ``weights_only``). Clients are named by partition id."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up what :meth:`state_dict` returned, to resume a run."""
        self.check_state(state)

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint's strategy state with entries this strategy does not keep (:attr:`state_keys`)."""
        unknown = set(state) - self.state_keys
        if unknown:
            kept = f"keeps only {sorted(self.state_keys)}" if self.state_keys else "keeps no server state"
            raise ValueError(f"strategy {type(self).__name__} {kept}, but the checkpoint holds {sorted(unknown)}")
