"""Client faults and resume: failed, late or malformed replies are dropped with a reason and never reach the
global model; a run checkpoints every round and ``resume-from`` continues it without losing or repeating rounds.

Most tests run the real ServerApp (``run_experiment``) against :class:`InProcessGrid`, whose nodes are the real
ClientApp called in this process (no Ray, no SuperLink), so they take seconds; the ``slow`` ones run Flower's
simulation.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.simulation import run_simulation
from flwr.supercore.task_identity import TaskIdentity

from core.config import RunConfig
from core.nodes import send_and_receive
from core.rounds import MetricAggregation, RoundRunner
from core.strategy import Reply, RunContext, ServerStrategy
from fl_app import checkpoint as checkpoint_module
from fl_app import server_app
from fl_app.checkpoint import CHECKPOINT, capture, load_checkpoint, save_checkpoint
from fl_app.client_app import build_client_app
from fl_app.config import ConfigError, default_run_config, parse_run_config
from fl_app.inprocess import InProcessGrid
from fl_app.server_app import build_server_app, run_experiment
from models.protocol import ModelHead
from strategies import get_strategy, list_strategies

TINY = {
    "dataset": "digits",
    "model": "small-mlp",
    "num-server-rounds": 2,
    "min-available-nodes": 3,
    "batch-size": 32,
    "device": "cpu",
}
MODELS = {"psinet": "psi-vgg9"}  # every other strategy runs the small MLP
SLOW_MODELS = {"psinet"}  # a convolutional net: tens of seconds on a loaded CPU


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch):
    """Flower stamps every message with the process's task identity, which its runtimes set; here no runtime runs."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _corrupt(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[RecordDict], None]:
    def apply(content: RecordDict) -> None:
        state = content["arrays"].to_torch_state_dict()
        change(state)
        content["arrays"] = ArrayRecord(state)

    return apply


def _first(state: dict[str, torch.Tensor]) -> str:
    return next(iter(state))


CORRUPTIONS: dict[str, Callable[[RecordDict], None]] = {
    "nan": _corrupt(lambda s: s[_first(s)].fill_(math.nan)),
    "inf": _corrupt(lambda s: s[_first(s)].fill_(math.inf)),
    "shape": _corrupt(lambda s: s.update({_first(s): s[_first(s)].flatten()[:-1].clone()})),
    "missing": _corrupt(lambda s: s.pop(next(reversed(s)))),
}


class FaultyGrid(InProcessGrid):
    """In-process nodes whose training replies go wrong as ``faults`` says, per partition: ``raise`` (an error
    reply, as Flower sends when the ClientApp raises), ``late`` (no reply within the timeout), ``gone`` (the node
    died: the SuperLink answers for it, from its own node id) or a key of :data:`CORRUPTIONS`."""

    def __init__(
        self, app: ClientApp, num_nodes: int, faults: dict[int, str] | None = None, first_node_id: int = 1000
    ) -> None:
        super().__init__(app, num_nodes, first_node_id)
        self.faults = faults or {}
        self.timeouts: list[float | None] = []

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        self.timeouts.append(timeout)
        replies = []
        for message in messages:
            context = self.contexts[message.metadata.dst_node_id]
            training = message.metadata.message_type == MessageType.TRAIN
            fault = self.faults.get(int(context.node_config["partition-id"])) if training else None
            if fault == "late":
                continue
            if fault == "gone":
                message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, "node unavailable"), reply_to=message)
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                replies.append(reply)
                continue
            if fault == "raise":
                message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                replies.append(
                    Message(
                        Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "RuntimeError: injected client failure"),
                        reply_to=message,
                    )
                )
                continue
            reply = self.deliver(message)
            if fault in CORRUPTIONS:
                CORRUPTIONS[fault](reply.content)
            replies.append(reply)
        return replies


def run(
    tmp_path: Path,
    name: str,
    num_nodes: int = 3,
    faults: dict[int, str] | None = None,
    first_node_id: int = 1000,
    **settings,
) -> tuple[Path, FaultyGrid]:
    """One in-process run of the real ServerApp; returns its folder and grid."""
    values = {**TINY, "min-available-nodes": num_nodes, "results-dir": str(tmp_path), "run-name": name, **settings}
    grid = FaultyGrid(build_client_app(values), num_nodes, faults, first_node_id)
    run_experiment(grid, parse_run_config(values))
    return tmp_path / name, grid


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def without_clock(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed-s"} for r in records]


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pt")


# --- client faults ---------------------------------------------------------------------------------------


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
        "model": MODELS.get(strategy, "small-mlp"),
        **({"superfed-start": 0.0} if strategy == "superfed" else {}),
    }
    malformed, _ = run(tmp_path, "malformed", faults={1: "nan", 2: "missing"}, **settings)
    absent, _ = run(tmp_path, "absent", faults={1: "raise", 2: "late"}, **settings)
    reference = final_model(absent)
    assert all(torch.equal(final_model(malformed)[k], reference[k]) for k in reference)
    records = rows(malformed)
    assert [r["clients-trained"] for r in records[1:]] == [1, 1]
    assert records[-1]["loss"] != records[0]["loss"]  # partition 0's updates went in


class ScriptedGrid(InProcessGrid):
    """Nodes that answer every training message with what ``script`` says for their partition: a metrics
    dict and arrays (a reply), or None (an error reply); queries and evaluations as a real node does."""

    def __init__(self, script: dict[int, tuple[dict[str, torch.Tensor], dict] | None]) -> None:
        super().__init__(ClientApp(), len(script))
        self.script = script

    def deliver(self, message: Message) -> Message:
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        partition = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        kind = message.metadata.message_type
        if kind == MessageType.QUERY:
            return Message(
                RecordDict({"metrics": MetricRecord({"partition-id": partition, "num-partitions": len(self.script)})}),
                reply_to=message,
            )
        if kind == MessageType.EVALUATE:
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=message)
        scripted = self.script[partition]
        if scripted is None:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=message)
        arrays, metrics = scripted
        return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}), reply_to=message)


def _fold(records, key):
    return MetricRecord({"n": len(records)})


def scripted_runner(script, name: str = "fedavg", server=None, **values) -> tuple[RoundRunner, list]:
    """A round runner over :class:`ScriptedGrid` for a model with one array ``w`` of zeros; also returns the
    list that collects ``(round, what was reported)``."""
    config = parse_run_config({**TINY, "strategy": name, "min-available-nodes": len(script), **values})
    context = RunContext(config, ArrayRecord({"w": torch.zeros(2)}), None, ModelHead((), 2))
    seen: list = []
    metrics = MetricAggregation(
        lambda records, key: seen.append(("train", len(records))) or MetricRecord(),
        lambda records, key: seen.append(("evaluate", len(records))) or MetricRecord(),
        lambda round_, participation: seen.append(("participation", participation)),
    )
    strategy = (server or get_strategy(name).server)(context)
    return RoundRunner(strategy, ScriptedGrid(script), metrics), seen


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
        return ArrayRecord({"w": torch.full((2,), math.nan)})


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


# --- checkpoints and resume ------------------------------------------------------------------------------


RESUMABLE = {"num-server-rounds": 4, "fraction-train": 0.5, "strategy": "fedavgm"}


def test_a_resumed_run_continues_exactly_where_the_straight_run_goes(tmp_path):
    """FedAvgM (server momentum) with half the clients sampled: a run stopped after round 2 and resumed on
    other node ids gives rounds 3 and 4 as the uninterrupted run does, each round once."""
    straight, _ = run(tmp_path, "straight", num_nodes=4, **RESUMABLE)
    stopped, _ = run(tmp_path, "stopped", num_nodes=4, **{**RESUMABLE, "num-server-rounds": 2})
    assert load_checkpoint(stopped).round == 2
    run(tmp_path, "ignored", num_nodes=4, first_node_id=555, **{**RESUMABLE, "resume-from": str(stopped)})
    assert not (tmp_path / "ignored").exists()  # a resumed run writes into the folder it resumes
    assert without_clock(rows(stopped)) == without_clock(rows(straight))
    assert [r["round"] for r in rows(stopped)] == [0, 1, 2, 3, 4]
    assert all(r["clients-trained"] == 2 for r in rows(stopped)[1:])
    model = final_model(stopped)
    assert all(torch.equal(model[k], final_model(straight)[k]) for k in model)
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["clients-per-round"] == [2, 2, 2, 2]
    assert json.loads((stopped / "config.json").read_text())["resume-from"] == str(stopped)


def test_a_run_resumed_after_a_round_the_server_did_not_evaluate_goes_as_the_straight_run(tmp_path, monkeypatch):
    """With ``server-evaluate-every`` 2 the server scores rounds 0, 2, 4 and the last; a run stopped after round
    3's checkpoint and resumed writes the straight run's rows, with no scores in rounds 1 and 3."""
    settings = {**RESUMABLE, "num-server-rounds": 5, "server-evaluate-every": 2}
    straight, _ = run(tmp_path, "straight", num_nodes=4, **settings)

    def stop_after_round_3(folder, checkpoint):
        save_checkpoint(folder, checkpoint)
        if checkpoint.round == 3:
            raise KeyboardInterrupt("the server stops after round 3")

    monkeypatch.setattr(server_app, "save_checkpoint", stop_after_round_3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "stopped", num_nodes=4, **settings)
    stopped = tmp_path / "stopped"
    assert load_checkpoint(stopped).round == 3 and "accuracy" not in rows(stopped)[-1]
    monkeypatch.setattr(server_app, "save_checkpoint", save_checkpoint)
    run(tmp_path, "ignored", num_nodes=4, first_node_id=555, **{**settings, "resume-from": str(stopped)})
    assert without_clock(rows(stopped)) == without_clock(rows(straight))
    assert [r["round"] for r in rows(straight) if "accuracy" in r and "loss" in r] == [0, 2, 4, 5]
    assert all("accuracy" not in r and "loss" not in r and r["clients-trained"] == 2 for r in rows(straight)[1:4:2])
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["final-accuracy"] == rows(straight)[5]["accuracy"]
    assert summary["best-accuracy"] == max(rows(straight)[r]["accuracy"] for r in (2, 4, 5))


def test_a_crash_between_a_rounds_metrics_and_its_checkpoint_loses_and_repeats_nothing(tmp_path, monkeypatch):
    straight, _ = run(tmp_path, "straight", **{"num-server-rounds": 3, "strategy": "fedma"})

    def crash_at_round_2(folder, checkpoint):
        if checkpoint.round == 2:
            raise KeyboardInterrupt("the server dies after writing round 2's metrics")
        return save_checkpoint(folder, checkpoint)

    monkeypatch.setattr(server_app, "save_checkpoint", crash_at_round_2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "crashed", **{"num-server-rounds": 3, "strategy": "fedma"})
    crashed = tmp_path / "crashed"
    assert [r["round"] for r in rows(crashed)] == [0, 1, 2] and load_checkpoint(crashed).round == 1
    monkeypatch.setattr(server_app, "save_checkpoint", save_checkpoint)
    # FedMA is mid-cycle after round 1: the clients' aligned models are carried by partition to new node ids
    run(
        tmp_path,
        "again",
        first_node_id=4242,
        **{"num-server-rounds": 3, "strategy": "fedma", "resume-from": str(crashed)},
    )
    assert without_clock(rows(crashed)) == without_clock(rows(straight))
    model = final_model(crashed)
    assert all(torch.equal(model[k], final_model(straight)[k]) for k in model)


def test_client_sampling_ignores_other_draws_from_the_global_random():
    """The round runner samples with its own seeded ``random.Random``: other code drawing from the global
    stream (Flower's threads, Ray) changes nothing, and the draws differ between rounds."""

    def sampled(perturb: bool) -> list[list[int]]:
        runner, _ = scripted_runner(
            {p: ({"w": torch.ones(2)}, {"num-examples": 1}) for p in range(6)}, **{"fraction-train": 0.5, "seed": 3}
        )
        rounds = []
        for _ in range(3):
            if perturb:
                random.random()
            rounds.append(sorted(runner._sample(runner.nodes.trainable(), 0.5)))
        return rounds

    random.seed(0)
    first = sampled(perturb=False)
    random.seed(1)
    assert sampled(perturb=True) == first
    assert len({tuple(nodes) for nodes in first}) > 1


def test_resume_refuses_a_missing_folder_or_checkpoint_and_changed_keys(tmp_path):
    def resume(**settings):
        values = {**TINY, "results-dir": str(tmp_path), "run-name": "new", **settings}
        run_experiment(InProcessGrid(build_client_app(values), 3), parse_run_config(values))

    with pytest.raises(ConfigError, match="no such folder"):
        resume(**{"resume-from": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"holds no {CHECKPOINT}"):
        resume(**{"resume-from": str(tmp_path / "empty")})
    folder, _ = run(tmp_path, "done", **{"num-server-rounds": 2})
    for key, value in [
        ("strategy", "fedprox"),
        ("seed", 3),
        ("dirichlet-alpha", 0.1),
        ("pan-mode", "mul"),
        ("model", "twonn"),
        ("fraction-train", 0.5),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}': checkpoint .*, now {value!r}"):
            resume(**{"resume-from": str(folder), key: value, "num-server-rounds": 3})
    with pytest.raises(ConfigError, match="already completed round 2; set at least 2"):
        resume(**{"resume-from": str(folder), "num-server-rounds": 1})
    (folder / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        resume(**{"resume-from": str(folder), "num-server-rounds": 3})
    assert not (tmp_path / "new").exists()


def test_a_key_stored_on_one_side_only_counts_as_its_default_on_resume():
    """A run stores only its own partitioner's keys; checkpoints from before partitioners had settings classes
    store every partitioner's key, at its default unless that partitioner was chosen."""
    config = parse_run_config({"partitioner": "shard", "shards-per-client": 3})
    saved = {**default_run_config(), **config.to_run_config()}
    assert "classes-per-client" in saved and "classes-per-client" not in config.to_run_config()
    assert checkpoint_module.config_differences(saved, config) == {}
    assert checkpoint_module.config_differences({**saved, "classes-per-client": 4}, config) == {
        "classes-per-client": (4, 2)
    }
    assert checkpoint_module.config_differences({**saved, "shards-per-client": 2}, config) == {
        "shards-per-client": (2, 3)
    }


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [("resume-from", "runs/a", "absolute"), ("round-timeout", 0.0, "> 0"), ("round-timeout", math.inf, "> 0")],
)
def test_resume_and_timeout_keys_are_checked(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_run_config({key: value})


def _server_after_rounds(name: str, rounds: int) -> tuple[ServerStrategy, ArrayRecord]:
    """The server side of ``name`` after ``rounds`` aggregations of two fake replies, and its global model."""
    config = parse_run_config({"strategy": name})
    context = RunContext(config, ArrayRecord({"w": torch.zeros(3)}), None, ModelHead((), 2))
    server = get_strategy(name).server(context)
    reference = context.initial_arrays
    if name == "scaffold":  # plan_train sets c to zeros in round 1
        server.plan_train(1, reference, ConfigRecord(), lambda: [], SimpleNamespace(trainable=lambda: [1, 2]))
    for round_ in range(1, rounds + 1):
        reference = server.aggregate(round_, _replies(name, float(round_)), reference)
    return server, reference


def _replies(name: str, value: float) -> list[Reply]:
    replies = []
    for node in (1, 2):
        content = RecordDict(
            {"arrays": ArrayRecord({"w": torch.full((3,), value + node)}), "metrics": MetricRecord({"num-examples": 4})}
        )
        if name == "scaffold":
            content["control"] = ArrayRecord({"w": torch.full((3,), 0.5)})
        replies.append(Reply(node, node - 1, content, 4.0))
    return replies


@pytest.mark.parametrize("name", ["fedavgm", "scaffold"])
def test_server_state_survives_a_checkpoint_file(tmp_path, name):
    server, reference = _server_after_rounds(name, 2)
    assert server.state_dict()  # these strategies carry something from round to round
    recorder = {"rows": [{"round": 0, "accuracy": 0.1}], "extra-keys": [], "elapsed-s": 1.0}
    runner = SimpleNamespace(strategy=server, sampling_state=random.Random(0).getstate())
    save_checkpoint(tmp_path, capture(2, server.context.config, reference, runner, recorder))
    fresh, _ = _server_after_rounds(name, 0)
    fresh.load_state_dict(load_checkpoint(tmp_path).strategy_state)
    expected = server.aggregate(3, _replies(name, 7.0), reference)
    got = fresh.aggregate(3, _replies(name, 7.0), reference)
    np.testing.assert_array_equal(got["w"].numpy(), expected["w"].numpy())


def test_a_stateless_strategy_refuses_foreign_state():
    server, _ = _server_after_rounds("fedavg", 0)
    assert server.state_dict() == {}
    with pytest.raises(ValueError, match="keeps no server state"):
        server.load_state_dict({"control": {}})


def test_the_checkpoint_is_replaced_whole(tmp_path):
    config = RunConfig()
    runner = SimpleNamespace(
        strategy=ServerStrategy(RunContext(config, ArrayRecord(), None, ModelHead((), 2))),
        sampling_state=random.Random(5).getstate(),
    )
    recorder = {"rows": [], "extra-keys": [], "elapsed-s": 0.0}
    save_checkpoint(tmp_path, capture(1, config, ArrayRecord({"w": torch.zeros(2)}), runner, recorder))
    save_checkpoint(tmp_path, capture(2, config, ArrayRecord({"w": torch.ones(2)}), runner, recorder))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT]  # no temporary file left behind
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 2 and torch.equal(torch.from_numpy(loaded.arrays["w"].numpy()), torch.ones(2))
    assert loaded.sampling_random == runner.sampling_state
    assert checkpoint_module.config_differences(loaded.config, config.replace(num_server_rounds=50)) == {}


# --- Flower's simulation (Ray) ---------------------------------------------------------------------------

BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


def simulate(tmp_path: Path, name: str, client_app: ClientApp | None = None, num_nodes: int = 4, **settings) -> Path:
    values = {**TINY, "min-available-nodes": num_nodes, "results-dir": str(tmp_path), "run-name": name, **settings}
    run_simulation(
        server_app=build_server_app(values),
        client_app=client_app or build_client_app(values),
        num_supernodes=num_nodes,
        backend_config=BACKEND,
    )
    return tmp_path / name


@pytest.mark.slow
@pytest.mark.long
def test_simulation_resumed_after_round_2_equals_the_straight_run(tmp_path):
    settings = {"num-server-rounds": 4, "fraction-train": 0.5}
    straight = simulate(tmp_path, "straight", **settings)
    stopped = simulate(tmp_path, "stopped", **{**settings, "num-server-rounds": 2})
    simulate(tmp_path, "resumed", **{**settings, "resume-from": str(stopped)})
    assert [r["round"] for r in rows(stopped)] == [0, 1, 2, 3, 4]
    assert without_clock(rows(stopped)) == without_clock(rows(straight))


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
    monkeypatch.setattr("core.nodes.REPLY_POLL_S", 0.0)
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
