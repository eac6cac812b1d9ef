"""Client state on the node's disk: what strategies keep in ``context.state`` survives a resume, so a run stopped
after round 2 and resumed on fresh nodes (new SuperNode processes, empty contexts) equals the uninterrupted run.

The runs are the real ServerApp and ClientApp in one process (:class:`alignfl.fl_app.inprocess.InProcessGrid`); the
nodes' ``state-dir`` is a temporary folder. The slow test runs Flower's simulation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.simulation import run_simulation

from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.node_state import MARKER, STATE_DIR_KEY, StateStore, begin_message, end_train, state_store
from alignfl.fl_app.server_app import build_server_app, run_experiment

TINY = {"dataset": "digits", "model": "small-mlp", "batch-size": 32, "device": "cpu", "fraction-train": 0.5}
STATEFUL = {"scaffold": {}, "superfed": {"superfed-start": 0.0}, "moon": {}, "fedper": {}, "ditto": {}}
"""Every strategy whose clients keep state, with settings that make them use it from round 1."""


def run(results: Path, state_dir: Path, name: str, num_nodes: int = 4, **settings) -> Path:
    """One in-process run on fresh nodes whose client state lives under ``state_dir``; returns its folder."""
    values = {**TINY, "results-dir": str(results), "run-name": name, "min-available-nodes": num_nodes, **settings}
    grid = InProcessGrid(build_client_app(values), num_nodes)
    for context in grid.contexts.values():
        context.node_config[STATE_DIR_KEY] = str(state_dir)
    run_experiment(grid, parse_run_config(values))
    return results / (Path(values["resume-from"]).name if "resume-from" in values else name)


def rows(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "elapsed-s"}
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


def same_models(a: Path, b: Path) -> bool:
    first, second = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("strategy", list(STATEFUL))
def test_a_resumed_run_on_fresh_nodes_equals_the_uninterrupted_one(tmp_path, strategy):
    settings = {"strategy": strategy, "num-server-rounds": 4, **STATEFUL[strategy]}
    straight = run(tmp_path, tmp_path / "state", "straight", **settings)
    stopped = run(tmp_path, tmp_path / "state", "stopped", **{**settings, "num-server-rounds": 2})
    run(tmp_path, tmp_path / "state", "ignored", **{**settings, "resume-from": str(stopped)})
    assert [r["round"] for r in rows(stopped)] == [0, 1, 2, 3, 4]
    assert rows(stopped) == rows(straight)
    assert same_models(stopped, straight)
    partitions = sorted((tmp_path / "state" / "stopped").iterdir())
    assert [p.name for p in partitions] == [f"partition-{i}" for i in range(4)]
    assert all(1 <= len(list(p.glob("round-*.pb"))) <= 2 for p in partitions)  # the last two rounds at most


def test_without_the_saved_state_scaffold_would_not_continue_exactly(tmp_path):
    """The check above has teeth: nodes that start the resumed run with empty state end elsewhere."""
    settings = {"strategy": "scaffold", "num-server-rounds": 4}
    straight = run(tmp_path, tmp_path / "state", "straight", **settings)
    stopped = run(tmp_path, tmp_path / "state", "stopped", **{**settings, "num-server-rounds": 2})
    run(tmp_path, tmp_path / "elsewhere", "ignored", **{**settings, "resume-from": str(stopped)})
    assert rows(stopped)[:3] == rows(straight)[:3]
    assert rows(stopped)[3:] != rows(straight)[3:]


# --- the store --------------------------------------------------------------------------------------------


def node(state_dir: Path | str | None, partition: int = 0) -> Context:
    node_config = {"partition-id": partition, "num-partitions": 2}
    if state_dir is not None:
        node_config[STATE_DIR_KEY] = str(state_dir)
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def some_state(value: float) -> RecordDict:
    return RecordDict(
        {
            "c": ArrayRecord({"w": torch.full((2,), value)}),
            "info": MetricRecord({"rounds": 3}),
            "note": ConfigRecord({"mode": "mm"}),
        }
    )


def test_snapshots_round_trip_exactly_and_only_the_last_two_are_kept(tmp_path):
    store = StateStore(tmp_path / "p")
    for server_round in (1, 2, 3):
        store.save(server_round, some_state(server_round + 0.1))
    assert sorted(store.snapshots()) == [2, 3]
    found, state = store.restore_before(4)
    assert found == 3 and list(state.keys()) == ["c", "info", "note"]
    assert torch.equal(state["c"].to_torch_state_dict()["w"], torch.full((2,), 3.1))
    assert state["info"]["rounds"] == 3 and state["note"]["mode"] == "mm"


def test_a_resumed_run_never_takes_state_of_a_round_it_repeats(tmp_path):
    """The server checkpointed round 2 and crashed during round 3: the node's round-3 state is discarded."""
    config = parse_run_config({**TINY, "resume-from": str(tmp_path / "results" / "run")})
    context = node(tmp_path / "state")
    store = state_store(context, config, 0)
    store.save(2, some_state(2.0))
    store.save(3, some_state(3.0))
    begin_message(context, config, 0, 3)
    assert torch.equal(context.state["c"].to_torch_state_dict()["w"], torch.full((2,), 2.0))
    assert sorted(store.snapshots()) == [2]
    context.state["c"] = ArrayRecord({"w": torch.zeros(2)})
    begin_message(context, config, 0, 4)  # only the node's first message restores
    assert torch.equal(context.state["c"].to_torch_state_dict()["w"], torch.zeros(2))


def test_a_new_run_forgets_what_an_earlier_run_of_the_same_name_left_and_never_saves_the_marker(tmp_path):
    config = parse_run_config({**TINY, "run-name": "run"})
    earlier = state_store(node(tmp_path), config, 1)
    earlier.save(9, some_state(9.0))
    context = node(tmp_path, partition=1)
    begin_message(context, config, 1, 1)
    assert earlier.snapshots() == {} and list(context.state.keys()) == [MARKER]
    context.state["c"] = ArrayRecord({"w": torch.ones(2)})
    end_train(context, config, 1, 1)
    assert list(earlier.load(earlier.snapshots()[1]).keys()) == ["c"]
    assert earlier.folder == (tmp_path / "run" / "partition-1").resolve()


def test_a_stateless_client_writes_nothing_but_one_that_kept_state_records_that_it_has_none_now(tmp_path):
    config = parse_run_config({**TINY, "run-name": "run"})
    stateless, emptied = node(tmp_path, partition=0), node(tmp_path, partition=1)
    for partition, context in enumerate((stateless, emptied)):
        begin_message(context, config, partition, 1)
    emptied.state["c"] = ArrayRecord({"w": torch.ones(2)})
    for partition, context in enumerate((stateless, emptied)):
        end_train(context, config, partition, 1)
    del emptied.state["c"]
    for partition, context in enumerate((stateless, emptied)):
        end_train(context, config, partition, 2)
    assert not state_store(stateless, config, 0).folder.exists()
    store = state_store(emptied, config, 1)
    assert sorted(store.snapshots()) == [1, 2] and len(store.load(store.snapshots()[2])) == 0


def test_state_dir_must_be_absolute_and_clients_write_only_inside_it(tmp_path):
    config = parse_run_config({**TINY, "run-name": "run"})
    with pytest.raises(ValueError, match="'state-dir' = 'relative/dir' must be an absolute path"):
        state_store(node("relative/dir"), config, 0)
    with pytest.raises(ValueError, match="not a plain folder name"):
        state_store(node(tmp_path), parse_run_config({**TINY, "resume-from": "/results/.."}), 0)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "run").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(ValueError, match="outside the state root"):
        state_store(node(tmp_path / "root"), config, 0)


def test_a_run_without_a_name_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    context = node(None)
    config = parse_run_config(TINY)
    assert state_store(context, config, 0) is None
    begin_message(context, config, 0, 1)
    context.state["c"] = ArrayRecord({"w": torch.ones(2)})
    end_train(context, config, 0, 1)
    assert not any(tmp_path.rglob("*.pb"))


def test_an_unwritable_state_dir_only_costs_the_resume(tmp_path, caplog):
    """The client goes on with its state in memory; the log says where it could not be written and what that
    costs."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    context = node(blocker)
    config = parse_run_config({**TINY, "run-name": "run"})
    begin_message(context, config, 0, 1)
    context.state["c"] = ArrayRecord({"w": torch.ones(2)})
    with caplog.at_level(logging.WARNING):
        end_train(context, config, 0, 1)  # raises nothing
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"cannot write client state to {blocker}" in warnings[0] and "a resumed run will not have it" in warnings[0]
    assert context.state["c"]["w"].numpy().tolist() == [1.0, 1.0]  # nothing lost in memory
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
@pytest.mark.long
def test_a_resumed_simulation_equals_the_uninterrupted_one_for_scaffold(tmp_path, monkeypatch):
    """Flower's simulation (Ray actors, the default state root under their home): new nodes per run."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the actors inherit it

    def simulate(name: str, **settings) -> None:
        values = {
            **TINY,
            "strategy": "scaffold",
            "results-dir": str(tmp_path),
            "run-name": name,
            "min-available-nodes": 3,
            "num-server-rounds": 3,
            **settings,
        }
        run_simulation(
            server_app=build_server_app(values),
            client_app=build_client_app(values),
            num_supernodes=3,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )

    simulate("straight")
    simulate("stopped", **{"num-server-rounds": 2})
    simulate("resumed", **{"resume-from": str(tmp_path / "stopped")})
    assert rows(tmp_path / "stopped") == rows(tmp_path / "straight")
    assert same_models(tmp_path / "stopped", tmp_path / "straight")
    assert any((tmp_path / "home" / ".cache" / "alignfl" / "client-state" / "stopped").rglob("round-*.pb"))
