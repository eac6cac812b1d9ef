"""What the fault and resume tests share: the real ServerApp (``run_experiment``) against in-process nodes whose
replies go wrong on purpose (:class:`FaultyGrid`) or follow a script (:class:`ScriptedGrid`), and Flower's
simulation of the same apps; the run folders they write, read back."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.simulation import run_simulation
from flwr.supercore.task_identity import TaskIdentity

from alignfl.core.rounds.runner import MetricAggregation, RoundRunner
from alignfl.core.rounds.strategy import RunContext
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.server_app import build_server_app, run_experiment
from alignfl.models.protocol import ModelHead
from alignfl.strategies import get_strategy

TINY = {
    "dataset": "digits",
    "model": "small-mlp",
    "num-server-rounds": 2,
    "min-available-nodes": 3,
    "batch-size": 32,
    "device": "cpu",
}


def stamp_server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower stamps every message with the process's task identity, which its runtimes set; here no runtime runs
    (the body of each module's autouse fixture)."""
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
