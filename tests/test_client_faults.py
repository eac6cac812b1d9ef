"""Client faults: failed, late, malformed or absent replies are dropped with a reason and never reach the global
model, for every strategy; a reply whose metrics differ, an aggregate that is not finite and a dead node never stall
a round; a runtime's partition table saves the partition queries unless a node contradicts it; replies are polled
until all came or the round's timeout.

Most tests run the real ServerApp (``run_experiment``) against in-process nodes (tests/faulty_grids.py: the real
ClientApp called in this process, no Ray, no SuperLink), so they take seconds; the ``slow`` ones run Flower's
simulation.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from alignfl.core.rounds.nodes import send_and_receive
from alignfl.core.rounds.strategy import Merge, ServerStrategy
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.server_app import run_experiment
from alignfl.strategies import list_strategies
from tests.faulty_grids import (
    TINY,
    FaultyGrid,
    final_model,
    rows,
    run,
    scripted_runner,
    simulate,
    stamp_server_identity,
    without_clock,
)

MODELS = {"psinet": {"model": "psi-vgg9", "width-factor": 0.25}}  # every other strategy runs the small MLP
SLOW_MODELS = {"psinet"}  # a convolutional net, even at a quarter of its widths


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch):
    stamp_server_identity(monkeypatch)


def test_failed_late_gone_and_malformed_clients_are_dropped_with_their_reasons(tmp_path):
    faults = {1: "raise", 2: "nan", 3: "late", 4: "shape", 5: "gone"}
    folder, grid = run(tmp_path, "faults", num_nodes=6, faults=faults, **{"round-timeout": 7.5})
    records = rows(folder)
    assert [r["round"] for r in records] == [0, 1, 2]
    for row in records[1:]:
        assert (row["clients-sampled"], row["clients-trained"], row["clients-dropped"]) == (6, 1, 5)
        reasons = row["clients-dropped-reasons"]
        assert sorted(reasons) == ["1", "2", "3", "4", "5"]  # the SuperLink's answer named by the dead node
        assert "injected client failure" in reasons["1"]
        assert "NaN" in reasons["2"]
        assert "timeout" in reasons["3"]
        assert "shape" in reasons["4"]
        assert "node unavailable" in reasons["5"]
    assert all(timeout == 7.5 for timeout in grid.timeouts[1:])  # the partition QUERY has its own timeout
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["clients-per-round"] == [1, 1]
    assert all(torch.isfinite(t).all() for t in final_model(folder).values())


@pytest.mark.parametrize(
    "strategy",
    [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_MODELS else name for name in list_strategies()],
)
def test_a_dropped_reply_never_reaches_the_global_model(tmp_path, strategy):
    """For every strategy: NaN and incomplete replies leave the global model exactly as when those clients fail
    outright or never answer, while the remaining client's updates do change it."""
    settings = {
        "strategy": strategy,
        **MODELS.get(strategy, {"model": "small-mlp"}),
        **({"superfed-start": 0.0} if strategy == "superfed" else {}),
    }
    malformed, _ = run(tmp_path, "malformed", faults={1: "nan", 2: "missing"}, **settings)
    absent, _ = run(tmp_path, "absent", faults={1: "raise", 2: "late"}, **settings)
    reference = final_model(absent)
    assert all(torch.equal(final_model(malformed)[k], reference[k]) for k in reference)
    records = rows(malformed)
    assert [r["clients-trained"] for r in records[1:]] == [1, 1]
    assert records[-1]["loss"] != records[0]["loss"]  # partition 0's updates went in


def test_a_reply_whose_metric_keys_differ_is_dropped_instead_of_failing_the_round():
    examples = {"num-examples": 4}
    runner, seen = scripted_runner(
        {
            0: ({"w": torch.ones(2)}, {**examples, "loss": 1.0}),
            1: ({"w": torch.full((2,), 9.0)}, {**examples, "other": 1.0}),
            2: ({"w": torch.full((2,), 3.0)}, {**examples, "loss": 2.0}),
            3: None,
        }
    )
    arrays = runner.train_round(1, ArrayRecord({"w": torch.zeros(2)}))
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 2.0])  # partition 1 (odd keys) and 3 (error) left out
    participation = next(p for kind, p in seen if kind == "participation")
    assert (participation.sampled, participation.trained) == (4, 2)
    assert "metric keys differ" in participation.dropped["1"] and "boom" in participation.dropped["3"]
    assert ("train", 2) in seen


def test_malformed_evaluate_replies_are_left_out_of_the_means():
    runner, seen = scripted_runner({p: None for p in range(5)})
    scores = [
        {"num-examples": 3, "local-accuracy": 0.5},
        {"local-accuracy": 0.9},  # no example count
        {"num-examples": -1, "local-accuracy": 0.9},
        None,
        {"num-examples": 0, "local-accuracy": 0.0},
    ]  # an empty test split is fine

    def evaluate(message: Message) -> Message:
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        partition = int(runner.grid.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        if scores[partition] is None:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=message)
        return Message(RecordDict({"metrics": MetricRecord(scores[partition])}), reply_to=message)

    runner.nodes.connected()  # partitions learnt first, through the scripted queries
    runner.grid.deliver = evaluate
    runner.evaluate_round(1, ArrayRecord({"w": torch.zeros(2)}))
    assert seen == [("evaluate", 2)]


class _NanAggregate(ServerStrategy):
    """A server side whose aggregation is broken: the round runner must refuse what it returns."""

    def aggregate(self, server_round, replies, reference):
        return Merge(ArrayRecord({"w": torch.full((2,), math.nan)}))


def test_the_round_runner_refuses_an_aggregate_that_is_not_finite():
    runner, _ = scripted_runner({0: ({"w": torch.ones(2)}, {"num-examples": 1})}, server=_NanAggregate)
    final = runner.run(ArrayRecord({"w": torch.ones(2)}))
    assert torch.equal(torch.from_numpy(final["w"].numpy()), torch.ones(2))


def test_a_dead_node_never_stalls_later_rounds():
    """min-available-nodes is waited for (boundedly) before the first round only; afterwards each round
    samples the nodes that are connected."""
    runner, seen = scripted_runner({p: ({"w": torch.ones(2)}, {"num-examples": 1}) for p in range(3)})
    arrays = runner.train_round(1, ArrayRecord({"w": torch.zeros(2)}))
    del runner.grid.contexts[next(iter(runner.grid.contexts))]  # a node leaves
    runner.train_round(2, arrays)
    trained = [p.trained for kind, p in seen if kind == "participation"]
    assert trained == [3, 2]


class CountingGrid(FaultyGrid):
    """In-process nodes that count the messages they get, by type."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: Counter[str] = Counter()

    def deliver(self, message: Message) -> Message | None:
        self.received[message.metadata.message_type] += 1
        return super().deliver(message)


def run_with_table(tmp_path: Path, name: str, shift: int | None) -> tuple[list[dict], CountingGrid]:
    """Six nodes, half of them sampled per round; the runtime's partition table is right (``shift`` 0), shifted
    by ``shift`` partitions (wrong), or absent (None)."""
    values = {
        **TINY,
        "min-available-nodes": 6,
        "fraction-train": 0.5,
        "fraction-evaluate": 0.5,
        "results-dir": str(tmp_path),
        "run-name": name,
    }
    grid = CountingGrid(build_client_app(values), 6)
    table = {
        node: (int(context.node_config["partition-id"]) + (shift or 0)) % 6 for node, context in grid.contexts.items()
    }
    run_experiment(grid, parse_run_config(values), None if shift is None else lambda: table)
    return without_clock(rows(tmp_path / name)), grid


def test_a_runtime_partition_table_asks_one_node_and_runs_as_asking_every_node(tmp_path):
    asked_all, everyone = run_with_table(tmp_path, "asked", shift=None)
    from_table, one = run_with_table(tmp_path, "table", shift=0)
    assert everyone.received[MessageType.QUERY] == 6 and one.received[MessageType.QUERY] == 1
    assert from_table == asked_all  # the same partitions sampled, folded and named in every round


def test_a_partition_table_a_node_contradicts_is_dropped(tmp_path, caplog):
    asked_all, _ = run_with_table(tmp_path, "asked", shift=None)
    with caplog.at_level("WARNING"):
        shifted, grid = run_with_table(tmp_path, "shifted", shift=2)
    assert "asking every node instead" in caplog.text
    assert grid.received[MessageType.QUERY] == 6  # the witness, then the five others
    assert shifted == asked_all


# --- Flower's simulation (Ray) ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_simulation_drops_a_client_that_raises_and_finishes(tmp_path):
    settings = {**TINY, "min-available-nodes": 3}
    inner = build_client_app(settings)
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if int(context.node_config["partition-id"]) == 1:
            raise RuntimeError("injected client failure")
        return inner(message, context)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return inner(message, context)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return inner(message, context)

    folder = simulate(tmp_path, "faulty", client_app=app, num_nodes=3)
    records = rows(folder)
    assert [r["round"] for r in records] == [0, 1, 2]
    for row in records[1:]:
        assert (row["clients-sampled"], row["clients-trained"], row["clients-dropped"]) == (3, 2, 1)
        assert "injected client failure" in row["clients-dropped-reasons"]["1"]
    assert json.loads((folder / "summary.json").read_text())["clients-per-round"] == [2, 2]


# --- polling for replies ---------------------------------------------------------------------------------


class SlowGrid(Grid):
    """A Flower Grid whose reply to the k-th message arrives at the k-th pull (and never, past ``replies``)."""

    def __init__(self, replies: int) -> None:
        self.replies, self.pulls, self.pushed = replies, 0, []

    def push_messages(self, messages):
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.pushed.append(message)
        return [message.metadata.message_id for message in self.pushed]

    def pull_messages(self, message_ids):
        self.pulls += 1
        due = self.pushed[self.pulls - 1] if self.pulls <= min(self.replies, len(self.pushed)) else None
        return (
            [Message(RecordDict(), reply_to=due)] if due is not None and due.metadata.message_id in message_ids else []
        )

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("the round runner polls itself")

    get_node_ids = set_run = run = create_message = None


def test_replies_are_polled_until_all_came_or_the_timeout(monkeypatch):
    monkeypatch.setattr("alignfl.core.rounds.nodes.REPLY_POLL_S", 0.0)
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN) for node in (1, 2, 3)]
    grid = SlowGrid(replies=3)
    replies = send_and_receive(grid, messages, timeout=10.0)
    assert [reply.metadata.reply_to_message_id for reply in replies] == [m.metadata.message_id for m in messages]
    assert grid.pulls == 3
    late = SlowGrid(replies=1)
    assert (
        len(
            send_and_receive(
                late,
                [Message(RecordDict(), dst_node_id=n, message_type=MessageType.TRAIN) for n in (1, 2)],
                timeout=0.05,
            )
        )
        == 1
    )
    assert late.pulls > 1
