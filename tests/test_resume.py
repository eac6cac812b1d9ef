"""Checkpoints and resume: a run checkpoints every round (the server's state, the sampling random's state and the
global model, replaced whole) and ``resume-from`` continues it, on other node ids, without losing or repeating
rounds; what cannot be resumed is refused before anything runs.

Most tests run the real ServerApp (``run_experiment``) against in-process nodes (tests/faulty_grids.py), so they
take seconds; the ``slow`` one runs Flower's simulation.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from alignfl.core.config import RunConfig
from alignfl.core.rounds.strategy import Reply, RunContext, ServerStrategy
from alignfl.fl_app import checkpoint as checkpoint_module
from alignfl.fl_app import server_app
from alignfl.fl_app.checkpoint import CHECKPOINT, capture, load_checkpoint, save_checkpoint
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import ConfigError, default_run_config, parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.server_app import run_experiment
from alignfl.models.protocol import ModelHead
from alignfl.strategies import get_strategy
from tests.faulty_grids import (
    TINY,
    final_model,
    rows,
    run,
    scripted_runner,
    simulate,
    stamp_server_identity,
    without_clock,
)


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch):
    stamp_server_identity(monkeypatch)


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
        reference = server.aggregate(round_, _replies(name, float(round_)), reference).arrays
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
    expected = server.aggregate(3, _replies(name, 7.0), reference).arrays
    got = fresh.aggregate(3, _replies(name, 7.0), reference).arrays
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


@pytest.mark.slow
@pytest.mark.long
def test_simulation_resumed_after_round_2_equals_the_straight_run(tmp_path):
    settings = {"num-server-rounds": 4, "fraction-train": 0.5}
    straight = simulate(tmp_path, "straight", **settings)
    stopped = simulate(tmp_path, "stopped", **{**settings, "num-server-rounds": 2})
    simulate(tmp_path, "resumed", **{**settings, "resume-from": str(stopped)})
    assert [r["round"] for r in rows(stopped)] == [0, 1, 2, 3, 4]
    assert without_clock(rows(stopped)) == without_clock(rows(straight))
