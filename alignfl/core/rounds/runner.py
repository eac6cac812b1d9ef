"""One round runner for every algorithm: sampling, messages, reply checks, metrics, checkpoints, resume.

An algorithm's server side is a :class:`alignfl.core.rounds.strategy.ServerStrategy`; everything else is
the :class:`RoundRunner`'s, the same for all: who is sampled (a seeded ``random.Random`` of
its own), in which order replies are folded (partition order, since float sums depend on
order), which replies are dropped and why (:mod:`alignfl.core.rounds.replies`), how metrics are folded,
and what a checkpoint keeps. The nodes and their partitions are :mod:`alignfl.core.rounds.nodes`'.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from alignfl.core.rounds.nodes import NodeDirectory, PartitionTable, send_and_receive, wait_for_nodes
from alignfl.core.rounds.repair_round import PendingRepair, RepairStep
from alignfl.core.rounds.replies import (
    CONFIG_RECORD,
    METRICS_RECORD,
    MODEL_RECORD,
    NUM_EXAMPLES,
    arrays_problem,
    evaluate_reply_problem,
    odd_metric_keys,
)
from alignfl.core.rounds.strategy import Reply, ServerStrategy

MetricsAggregator = Callable[[list[RecordDict], str], MetricRecord]


@dataclass(frozen=True)
class Participation:
    """Who took part in one training round: sampled, aggregated, and why the others were left out.

    ``dropped`` maps a client (its partition id, or ``node <id>`` when the node never said) to the reason.
    """

    sampled: int
    trained: int
    dropped: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        """The round's ``metrics.jsonl`` entries."""
        return {
            "clients-sampled": self.sampled,
            "clients-trained": self.trained,
            "clients-dropped": len(self.dropped),
            "clients-dropped-reasons": dict(self.dropped),
        }


@dataclass(frozen=True)
class MetricAggregation:
    """How the server folds client metrics (the run's recorder supplies them so it sees every reply), and
    who hears about each training round's :class:`Participation` and each round's own metrics."""

    train: MetricsAggregator
    evaluate: MetricsAggregator
    participation: Callable[[int, Participation], None] | None = None
    round_metrics: Callable[[int, dict[str, Any]], None] | None = None


class RoundRunner:
    """Runs rounds ``first_round .. num-server-rounds`` of one strategy over a grid.

    * Sampling: ``int(fraction · nodes)`` nodes (at least one) drawn with the runner's own seeded
      ``random.Random`` from the nodes in partition order; its state is part of a checkpoint. Training
      samples only the nodes not held out (``holdout-clients``); evaluation samples all.
    * Clients evaluate the global model every ``evaluate-every`` rounds and in the last one.
    * Nodes: the first round waits up to ``node-wait-timeout`` for ``min-available-nodes``; later rounds use
      whoever is connected, so a node that dies never stalls the run.
    * Replies: an error reply, one that did not come within ``round-timeout``, a malformed one
      (:meth:`ServerStrategy.reply_problem`) or one whose metric keys differ from the others' is dropped and
      logged with its reason; each training round's :class:`Participation` is reported.
    * An aggregate that does not fit the global model (unless the strategy changes the model's shape) or is
      not finite is refused and the global model kept.
    """

    def __init__(
        self,
        strategy: ServerStrategy,
        grid: Grid,
        metrics: MetricAggregation,
        partition_table: PartitionTable | None = None,
    ) -> None:
        config = strategy.context.config
        self.strategy = strategy
        self.grid = grid
        self.config = config
        self.metrics = metrics
        self.nodes = NodeDirectory(grid, config.holdout_clients, partition_table)
        self.sampling = random.Random(config.seed)
        self.repair = RepairStep(self) if config.repair == "on" else None
        self.on_merged: Callable[[int, ArrayRecord, PendingRepair], None] | None = None
        """Called with a round's number, the global model it started from and its state after its merge, before
        each REPAIR query (``repair=on``): where the server checkpoints that state."""

    @property
    def sampling_state(self) -> Any:
        """The state of the client-sampling stream (a checkpoint keeps it)."""
        return self.sampling.getstate()

    @sampling_state.setter
    def sampling_state(self, state: Any) -> None:
        self.sampling.setstate(state)

    def run(
        self,
        initial_arrays: ArrayRecord,
        first_round: int = 1,
        evaluate_fn: Callable[[int, ArrayRecord], Any] | None = None,
        on_round_end: Callable[[int, ArrayRecord], None] | None = None,
        pending: PendingRepair | None = None,
    ) -> ArrayRecord:
        """Rounds ``first_round .. num-server-rounds``; returns the final global model. Each round trains,
        evaluates on clients, calls ``evaluate_fn(round, arrays)`` then ``on_round_end(round, arrays)``; round
        0 (``evaluate_fn`` on the initial arrays) runs only when ``first_round`` is 1. ``pending``: a round
        resumed after its merge, before one of its REPAIR queries (``first_round`` is its round), which asks that
        query again instead of training."""
        if first_round < 1:
            raise ValueError(f"first_round = {first_round} must be >= 1")
        last = self.config.num_server_rounds
        log(INFO, "Starting %s, rounds %d to %d", self.strategy.describe(), first_round, last)
        wait_for_nodes(self.grid, self.config.min_available_nodes, self.config.node_wait_timeout)
        arrays = initial_arrays
        if first_round == 1 and evaluate_fn is not None and pending is None:
            evaluate_fn(0, arrays)
        for server_round in range(first_round, last + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, last)
            if pending is not None and self.repair is not None and server_round == pending.server_round:
                log(INFO, "round %d: resumed between its merge and its REPAIR query", server_round)
                arrays = self.repair.finish(pending, arrays)
            else:
                arrays = self.train_round(server_round, arrays)
            if server_round % self.config.evaluate_every == 0 or server_round == last:
                self.evaluate_round(server_round, arrays)
            if evaluate_fn is not None:
                evaluate_fn(server_round, arrays)
            if on_round_end is not None:
                on_round_end(server_round, arrays)
        return arrays

    def _sample(self, nodes: list[int], fraction: float) -> list[int]:
        return self.sampling.sample(nodes, max(int(len(nodes) * fraction), 1)) if nodes else []

    def round_config(self, server_round: int) -> ConfigRecord:
        """The config record every message of round ``server_round`` carries."""
        return ConfigRecord({**self.config.pan_signature(), "server-round": server_round})

    def send(self, contents: dict[int, RecordDict], message_type: str) -> tuple[list[Message], dict[str, int]]:
        """Send one message per node and wait for the replies; also returns message id → node, since an
        error the SuperLink makes for a node that went away comes from the SuperLink's own node id."""
        messages = [Message(content, dst_node_id=node, message_type=message_type) for node, content in contents.items()]
        if not messages:
            return [], {}
        replies = send_and_receive(self.grid, messages, self.config.round_timeout)
        return replies, {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}

    def checked(
        self,
        replies: list[Message],
        destinations: dict[str, int],
        problem_of: Callable[[RecordDict], str | None],
        dropped: dict[str, str],
    ) -> list[Reply]:
        """The replies in partition order without errors, malformed contents or odd metric keys; the others'
        reasons go to ``dropped``."""
        well_formed = []
        for message in replies:
            node = destinations.get(message.metadata.reply_to_message_id, message.metadata.src_node_id)
            if message.has_error():
                problem = f"the client failed (error code {message.error.code}): {message.error.reason}"
            else:
                problem = problem_of(message.content)
            if problem is None:
                well_formed.append(Reply(node, self.nodes.partitions.get(node), message.content, self._weight(message)))
            else:
                dropped[self.nodes.name(node)] = problem
        well_formed.sort(key=lambda reply: self.nodes.position(reply.node))
        kept = []
        for reply, problem in zip(well_formed, odd_metric_keys([r.content for r in well_formed]), strict=True):
            if problem is None:
                kept.append(reply)
            else:
                dropped[self.nodes.name(reply.node)] = problem
        return kept

    def _weight(self, message: Message) -> float:
        if self.config.server_weighting == "uniform":
            return 1.0
        return message.content[METRICS_RECORD].get(NUM_EXAMPLES, 0)

    def train_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """One training round; returns the new global model, or ``arrays`` when nothing was aggregated."""
        contents = self.strategy.plan_train(
            server_round,
            arrays,
            self.round_config(server_round),
            lambda: self._sample(self.nodes.trainable(), self.config.fraction_train),
            self.nodes,
        )
        log(INFO, "configure_train: %d nodes", len(contents))
        replies, destinations = self.send(contents, MessageType.TRAIN)
        answered = {destinations.get(m.metadata.reply_to_message_id, m.metadata.src_node_id) for m in replies}
        dropped = {
            self.nodes.name(node): "no reply within the round's timeout" for node in contents if node not in answered
        }
        usable = self.checked(replies, destinations, lambda c: self.strategy.reply_problem(c, arrays), dropped)
        for client, reason in dropped.items():
            log(WARNING, "round %d: dropped client %s: %s", server_round, client, reason)
        if self.metrics.participation is not None:
            self.metrics.participation(server_round, Participation(len(answered | set(contents)), len(usable), dropped))
        if not usable:
            log(WARNING, "round %d: no usable training reply; the global model is unchanged", server_round)
            self.strategy.on_empty_round(server_round)
            return arrays
        self.metrics.train([r.content for r in usable], NUM_EXAMPLES)
        merge = self.strategy.aggregate(server_round, usable, self._alignment_reference(server_round, usable, arrays))
        if merge is None:
            return arrays
        if self.metrics.round_metrics is not None:
            self.metrics.round_metrics(server_round, merge.metrics)
        problem = self._aggregate_problem(merge.arrays, arrays)
        if problem is not None:
            log(
                WARNING,
                "round %d: the aggregated model is refused (%s); the global model is unchanged",
                server_round,
                problem,
            )
            return arrays
        if self.repair is not None:
            return self.repair.run(server_round, usable, merge, arrays)
        return merge.arrays

    def _alignment_reference(self, server_round: int, usable: list[Reply], arrays: ArrayRecord) -> ArrayRecord:
        """What an aligning strategy aligns onto: the global model, except in the first round of independently
        initialised clients, where no client started from it, and for a strategy that aligns onto a client
        (:attr:`~alignfl.core.rounds.strategy.ServerStrategy.aligns_onto_client`): then the first client's model
        (``usable`` is in partition order) whose shapes are the global model's."""
        independent = server_round == 1 and self.config.client_init == "independent"
        if not (self.strategy.aligns_to_reference and (independent or self.strategy.aligns_onto_client)):
            return arrays
        for reply in usable:
            if arrays_problem(reply.arrays, arrays, "reference") is None:
                why = "independent starts" if independent else "client reference"
                log(
                    INFO,
                    "round %d: %s, aligning onto client %s's model",
                    server_round,
                    why,
                    self.nodes.name(reply.node),
                )
                return reply.arrays
        return arrays

    def _aggregate_problem(self, aggregated: ArrayRecord, arrays: ArrayRecord) -> str | None:
        if self.strategy.changes_shapes:
            bad = [key for key, a in aggregated.items() if not np.isfinite(a.numpy()).all()]
            return f"arrays {bad[:5]} hold NaN or infinite values" if bad else None
        return arrays_problem(aggregated, arrays, "aggregate")

    def evaluate_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Every sampled node (held-out ones too) scores the global model on its local test split."""
        nodes = self._sample(self.nodes.connected(), self.config.fraction_evaluate)
        content = RecordDict({MODEL_RECORD: arrays, CONFIG_RECORD: self.round_config(server_round)})
        replies, destinations = self.send(dict.fromkeys(nodes, content), MessageType.EVALUATE)
        dropped: dict[str, str] = {}
        kept = self.checked(replies, destinations, evaluate_reply_problem, dropped)
        for client, reason in dropped.items():
            log(WARNING, "round %d: left out the evaluate reply of client %s: %s", server_round, client, reason)
        if kept:
            self.metrics.evaluate([r.content for r in kept], NUM_EXAMPLES)
