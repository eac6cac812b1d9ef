"""REPAIR in a training round: the query messages after the merge, and the round's state between them.

With ``repair=on`` a training round of a repairable strategy
(:attr:`alignfl.core.rounds.strategy.ServerStrategy.repairable`) goes on after its merge. Its training replies carried,
beside the model, the clients' per-unit statistics of their own trained models on their own training data
(:data:`alignfl.core.merging.repair.REPAIR_RECORD`); the server carries each client's statistics onto the merged model's
units (the unit maps of the strategy's :class:`~alignfl.core.rounds.strategy.Merge`) and then corrects the merged
model's layers in order from the input, one QUERY message per layer: the message carries the model with the layers
before it already corrected, its config asks for REPAIR statistics of that layer (:data:`QUERY_KEY` =
:data:`REPAIR_QUERY`, :data:`SITE_KEY`), every client of the round replies with that model's statistics on its training
data, and the server folds into the layer the correction that gives each of its units the averaged statistics of the
clients' own units (:func:`alignfl.core.merging.repair.repair_site`). This is REPAIR adapted to federated data: the
authors measure every endpoint and the merged model on one shared data set, which here would need every client to
evaluate every other client's model (:mod:`alignfl.core.merging.repair`'s notes).

One message per layer is what REPAIR does: its authors measure a layer behind the layers already reset. All
layers corrected from one set of statistics of the uncorrected merge over-correct: a later layer's measured
spread already lacks what the earlier layers lost, so it is scaled up for that too, on top of the earlier layers'
own correction, and the scales multiply with depth (on a narrow VGG-9 with BatchNorm, one set made the
last layers' corrections 18 to 76 times, and the next round's clients diverged). The cost: a layer's query is the
merged model down to every client and a forward pass of its training split up to that layer, a few KB back (that
layer's statistics); a model with ``L``
hidden layers (sites) adds ``L`` query messages to each round (small MLP 4, VGG-9 8, ResNet-20 19).

A client whose query reply fails, is late or malformed is dropped with its reason (``repair-dropped-reasons``)
and not asked again this round; each layer is averaged over the clients that answered its query (their own
statistics and the merged model's, like with like). When no client answers a layer's query the round keeps the
unrepaired merge and says why in the log and in the row (``repair: "skipped: <why>"``). The row also records
``repair-clients`` (the clients whose statistics made the last layer's correction), ``repair-layers`` and
``repair-std-change``, the mean over the corrected units of how far REPAIR moved a unit's std.

Before every query the round's state is a :class:`PendingRepair` (the merge, the model with the layers corrected
so far, each client's statistics on the merged units); the server checkpoints it, and a run resumed from that
checkpoint asks the same clients (by partition) that layer's query again instead of training the round again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Protocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log

from alignfl.core.merging.repair import (
    REPAIR_RECORD,
    Site,
    UnitStats,
    carry_statistics,
    repair_site,
    statistics_problem,
    statistics_shapes,
)
from alignfl.core.rounds.nodes import NodeDirectory
from alignfl.core.rounds.replies import CONFIG_RECORD, METRICS_RECORD, MODEL_RECORD, NUM_EXAMPLES, metric_record_problem
from alignfl.core.rounds.strategy import Merge, Reply, ServerStrategy
from alignfl.plugins.options import is_number

QUERY_KEY = "query"
"""The config-record key of a QUERY message that says what it asks for (none: the node's partition)."""
REPAIR_QUERY = "repair-statistics"
"""What a REPAIR query asks for: the received model's unit statistics on the client's training data."""
SITE_KEY = "repair-site"
"""The config-record key of a REPAIR query naming the layer (site) whose statistics it asks for."""


@dataclass(frozen=True)
class PendingRepair:
    """A training round after its merge, before the REPAIR query of layer ``done``: the merge, the model with
    layers ``0 .. done - 1`` corrected, and per client (by name: its partition id) its own model's unit statistics
    carried onto the merged units and its example count; the clients dropped so far and the std changes made."""

    server_round: int
    merged: ArrayRecord
    current: ArrayRecord
    clients: dict[str, dict[str, UnitStats]]
    examples: dict[str, float]
    done: int = 0
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    changes: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    def asked(self) -> list[str]:
        """The clients the next query goes to: those not dropped."""
        return [name for name in self.clients if name not in self.dropped]

    def state(self) -> dict[str, Any]:
        """Tensors and plain values, for a checkpoint (``torch.save``, read back with ``weights_only``)."""
        return {
            "round": self.server_round,
            "merged": self.merged.to_torch_state_dict(),
            "current": self.current.to_torch_state_dict(),
            "clients": {
                name: {site: {"mean": s.mean, "std": s.std, "held": s.held} for site, s in sites.items()}
                for name, sites in self.clients.items()
            },
            "examples": dict(self.examples),
            "done": self.done,
            "dropped": dict(self.dropped),
            "changes": self.changes,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PendingRepair:
        clients = {
            str(name): {site: UnitStats(s["mean"], s["std"], s["held"]) for site, s in sites.items()}
            for name, sites in state["clients"].items()
        }
        return cls(
            int(state["round"]),
            ArrayRecord(dict(state["merged"])),
            ArrayRecord(dict(state["current"])),
            clients,
            {str(name): float(count) for name, count in state["examples"].items()},
            int(state["done"]),
            {str(name): str(why) for name, why in state["dropped"].items()},
            state["changes"],
        )


class Runner(Protocol):
    """What REPAIR uses of the round runner (:class:`alignfl.core.rounds.runner.RoundRunner`), its public side only:
    its strategy, nodes and metric callbacks, how it sends a message to nodes, checks the replies and builds a
    round's config."""

    strategy: ServerStrategy
    nodes: NodeDirectory
    metrics: Any
    on_merged: Callable[[int, ArrayRecord, PendingRepair], None] | None

    def send(self, contents: dict[int, RecordDict], message_type: str) -> tuple[list[Message], dict[str, int]]: ...

    def checked(
        self,
        replies: list[Message],
        destinations: dict[str, int],
        problem_of: Callable[[RecordDict], str | None],
        dropped: dict[str, str],
    ) -> list[Reply]: ...

    def round_config(self, server_round: int) -> ConfigRecord: ...


def _shapes(arrays: ArrayRecord) -> dict[str, tuple[int, ...]]:
    return {key: tuple(array.shape) for key, array in arrays.items()}


class RepairStep:
    """The REPAIR part of a round runner's training rounds (module notes)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.strategy = runner.strategy

    def sites(self, groups: frozenset[str] | None) -> list[Site]:
        """The sites to correct this round: those of the permutation ``groups`` the merge merged (None: every
        group), in forward order."""
        sites = self.strategy.context.sites
        return [s for s in sites if groups is None or all(piece.group in groups for piece in s.pieces)]

    def pending_sites(self, pending: PendingRepair) -> list[Site]:
        """The sites a pending round's clients' statistics cover (a resumed strategy may not know them)."""
        names = set(next(iter(pending.clients.values())))
        return [site for site in self.strategy.context.sites if site.name in names]

    def prepare(self, server_round: int, replies: list[Reply], merge: Merge, sent: ArrayRecord) -> PendingRepair | str:
        """The round's state before its first query: each reply's statistics carried onto the merged units by the
        merge's unit maps (``sent``: the global model the clients got, whose widths stand for the layers a reply
        leaves out); or why there is nothing to repair."""
        sites = self.sites(merge.groups)
        if not sites:
            return "this round merged no hidden layer's units"
        maps = merge.unit_maps or [{} for _ in replies]
        merged = merge.arrays
        merged_shapes = _shapes(merged)
        clients, examples = {}, {}
        for reply, unit_maps in zip(replies, maps, strict=True):
            arrays = reply.arrays
            client_shapes = {**_shapes(sent), **_shapes(arrays)}
            held = {piece.prefix for site in sites for piece in site.pieces if piece.weight in arrays}
            statistics = reply.content[REPAIR_RECORD].to_torch_state_dict()
            name = self.runner.nodes.name(reply.node)
            clients[name] = carry_statistics(statistics, sites, client_shapes, merged_shapes, unit_maps, held)
            examples[name] = float(reply.content[METRICS_RECORD][NUM_EXAMPLES])
        return PendingRepair(server_round, merged, merged, clients, examples)

    def run(self, server_round: int, replies: list[Reply], merge: Merge, sent: ArrayRecord) -> ArrayRecord:
        """REPAIR of a round's merge (module notes); ``sent``: the global model the round started from."""
        pending = self.prepare(server_round, replies, merge, sent)
        if isinstance(pending, str):
            self._skip(server_round, pending, {})
            return merge.arrays
        return self.finish(pending, sent)

    def finish(self, pending: PendingRepair, start: ArrayRecord) -> ArrayRecord:
        """Correct the pending round's layers from ``pending.done`` on, one query each, the state checkpointed
        before each (``start``: the global model the round started from); the merge unrepaired when a layer's
        query gets no usable answer."""
        sites = self.pending_sites(pending)
        while pending.done < len(sites):
            if self.runner.on_merged is not None:
                self.runner.on_merged(pending.server_round, start, pending)
            dropped = dict(pending.dropped)
            step = self._layer(pending, sites[pending.done], dropped)
            if isinstance(step, str):
                self._skip(pending.server_round, step, dropped)
                return pending.merged
            pending = step
        self.strategy.on_repaired(pending.current)
        self._done(pending, len(sites))
        return pending.current

    def _layer(self, pending: PendingRepair, site: Site, dropped: dict[str, str]) -> PendingRepair | str:
        """Layer ``site`` corrected from its query's replies, or why it could not be; the clients dropped on the
        way go to ``dropped``."""
        replies = self._query(pending, site, dropped)
        if not replies:
            return f"no client answered the REPAIR query of layer '{site.name}'"
        shapes = _shapes(pending.current)
        names = [self.runner.nodes.name(reply.node) for reply in replies]
        measured = [
            carry_statistics(reply.content[REPAIR_RECORD].to_torch_state_dict(), [site], shapes, shapes)[site.name]
            for reply in replies
        ]
        targets = [pending.clients[name][site.name] for name in names]
        state, fix = repair_site(
            pending.current.to_torch_state_dict(), site, targets, measured, [pending.examples[n] for n in names]
        )
        if not all(torch.isfinite(value).all() for value in state.values() if value.is_floating_point()):
            return f"layer '{site.name}' repaired is not finite"
        return dataclasses.replace(
            pending,
            current=ArrayRecord(state),
            done=pending.done + 1,
            dropped=dropped,
            changes=torch.cat([pending.changes, fix.std_change]),
        )

    def _query(self, pending: PendingRepair, site: Site, dropped: dict[str, str]) -> list[Reply]:
        """The usable replies to the query of ``site`` with the pending model; the other clients' reasons go to
        ``dropped``."""
        runner, server_round = self.runner, pending.server_round
        nodes = self._recipients(pending, dropped)
        config = ConfigRecord({**runner.round_config(server_round), QUERY_KEY: REPAIR_QUERY, SITE_KEY: site.name})
        content = RecordDict({MODEL_RECORD: pending.current, CONFIG_RECORD: config})
        replies, destinations = runner.send(dict.fromkeys(nodes, content), MessageType.QUERY)
        answered = {destinations.get(m.metadata.reply_to_message_id, m.metadata.src_node_id) for m in replies}
        late = {runner.nodes.name(node): "no reply within the round's timeout" for node in set(nodes) - answered}
        expected = statistics_shapes([site], _shapes(pending.current))
        new: dict[str, str] = dict(late)
        kept = runner.checked(replies, destinations, lambda content: _query_problem(content, expected), new)
        for client, reason in new.items():
            log(WARNING, "round %d: REPAIR dropped client %s: %s", server_round, client, reason)
        dropped.update(new)
        return [reply for reply in kept if runner.nodes.name(reply.node) in pending.clients]

    def _recipients(self, pending: PendingRepair, dropped: dict[str, str]) -> list[int]:
        """The nodes of the pending round's clients still asked (by partition: a resumed run's nodes have new ids);
        a client no connected node holds goes to ``dropped``."""
        by_partition = self.runner.nodes.by_partition()
        connected = set(self.runner.nodes.connected())
        nodes = []
        for name in pending.asked():
            node = by_partition.get(int(name)) if name.isdigit() else int(name.removeprefix("node "))
            if node is None or node not in connected:
                dropped[name] = "no connected node holds this client"
            else:
                nodes.append(node)
        return nodes

    def _done(self, pending: PendingRepair, layers: int) -> None:
        change = float(pending.changes.mean()) if len(pending.changes) else 0.0
        clients = len(pending.asked())
        log(
            INFO,
            "round %d: REPAIR of %d layers from %d clients; mean change of a unit's std %.4g",
            pending.server_round,
            layers,
            clients,
            change,
        )
        self._record(
            pending.server_round,
            {
                "repair": "on",
                "repair-clients": clients,
                "repair-layers": layers,
                "repair-std-change": change,
                "repair-dropped-reasons": dict(pending.dropped),
            },
        )

    def _skip(self, server_round: int, why: str, dropped: dict[str, str]) -> None:
        log(WARNING, "round %d: REPAIR skipped (%s); the merged model is kept as it is", server_round, why)
        self._record(server_round, {"repair": f"skipped: {why}", "repair-dropped-reasons": dict(dropped)})

    def _record(self, server_round: int, metrics: dict[str, Any]) -> None:
        if self.runner.metrics.round_metrics is not None:
            self.runner.metrics.round_metrics(server_round, metrics)


def _query_problem(content: RecordDict, expected: Mapping[str, tuple[int]]) -> str | None:
    """What is wrong with a REPAIR query reply, or None: exactly the ArrayRecord of statistics (their entries and
    shapes as the queried model's), one MetricRecord ``"metrics"`` with a positive example count."""
    if sorted(content.array_records) != [REPAIR_RECORD]:
        return f"expected ArrayRecords ['{REPAIR_RECORD}'], got {sorted(content.array_records)}"
    problem = metric_record_problem(content)
    if problem is not None:
        return problem
    examples = content[METRICS_RECORD].get(NUM_EXAMPLES)
    if not is_number(examples) or not examples > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {examples!r}"
    try:
        statistics = content[REPAIR_RECORD].to_torch_state_dict()
    except (ValueError, TypeError) as error:
        return f"'{REPAIR_RECORD}' cannot be read: {error}"
    return statistics_problem(statistics, expected)
