"""Independent starts, one-shot runs and the server's scores of the clients' models (``server-ensemble``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from alignfl.core.data import dataset_info
from alignfl.core.merging.alignment import weighted_average
from alignfl.core.metrics.ensemble import score_models
from alignfl.core.model_io import build_model_for, build_run_model, federated_state, independent_start
from alignfl.core.rounds.strategy import ServerStrategy, build_context
from alignfl.core.training.sgd import seed_everything
from alignfl.fl_app.analysis.merge import strategy_merge, train_clients
from alignfl.fl_app.config import ConfigError, check_run, parse_run_config
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import build_model
from alignfl.models.pan import PanSettings

CLIENTS = 3
ONE_SHOT = {
    "model": "small-mlp",
    "dataset": "digits",
    "device": "cpu",
    "num-server-rounds": 1,
    "client-init": "independent",
    "server-ensemble": True,
    "local-epochs": 2,
    "batch-size": 16,
    "data-fraction": 0.5,
    "dirichlet-alpha": 0.5,
    "seed": 3,
}


def _config(**changes):
    return parse_run_config({**ONE_SHOT, **changes})


def _rows(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "elapsed-s"}
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_independent_starts_are_seeded_per_client_and_none_is_the_servers_model():
    config = _config()
    shape, classes = dataset_info(config.dataset)
    starts = [independent_start(config, shape, classes, client) for client in range(CLIENTS)]
    assert _equal_states(starts[0], independent_start(config, shape, classes, 0))  # reproducible
    assert not _equal_states(starts[0], starts[1]) and not _equal_states(starts[1], starts[2])
    seed_everything(config.seed)
    assert not _equal_states(starts[0], federated_state(build_model_for(config, shape, classes)))
    other_seed = _config(seed=4)
    assert not _equal_states(starts[0], independent_start(other_seed, shape, classes, 0))
    before = torch.random.get_rng_state()
    independent_start(config, shape, classes, 1)
    assert torch.equal(before, torch.random.get_rng_state())  # the process's stream is left alone


def test_a_one_shot_run_trains_each_client_from_its_own_start_on_every_engine(tmp_path):
    values = {**ONE_SHOT, "strategy": "fedavg", "results-dir": str(tmp_path)}
    run_in_process({**values, "run-name": "inprocess"}, CLIENTS)
    run_batched({**values, "run-name": "batched"}, CLIENTS, vectorise="off")
    assert _rows(tmp_path / "inprocess") == _rows(tmp_path / "batched")
    # the clients trained from independent starts: the merged model is the average of train_clients' models
    config = _config(strategy="fedavg")
    states, counts, _, _ = train_clients(config, CLIENTS, same_init=False, device=torch.device("cpu"))
    merged = torch.load(tmp_path / "inprocess" / "model.pt")
    expected = weighted_average(states, counts)
    assert all(torch.allclose(merged[k], expected[k], atol=1e-6) for k in expected)
    shared, _, _, _ = train_clients(config, CLIENTS, same_init=True, device=torch.device("cpu"))
    assert not torch.allclose(merged["classifier.weight"], weighted_average(shared, counts)["classifier.weight"])


@pytest.mark.parametrize("strategy", ["matched", "otfusion"])
def test_a_one_shot_run_merges_as_the_merge_tool_does(tmp_path, strategy):
    """Same clients, seed and keys: the run's merged model is the merge tool's, aligned onto client 0."""
    run_in_process({**ONE_SHOT, "strategy": strategy, "results-dir": str(tmp_path), "run-name": "run"}, CLIENTS)
    config = _config(strategy=strategy)
    states, counts, dataset, _ = train_clients(config, CLIENTS, same_init=False, device=torch.device("cpu"))
    model = build_run_model(config, dataset)
    merge = strategy_merge(config, model, strategy, {}, states, counts, states[0])  # the merge tool's
    expected = merge.arrays.to_torch_state_dict()
    merged = torch.load(tmp_path / "run" / "model.pt")
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    row = _rows(tmp_path / "run")[-1]
    assert sum(row["units-moved" if strategy == "matched" else "transport-off-diagonal"].values()) > 0


def test_the_server_scores_the_ensemble_and_the_best_client(tmp_path):
    run_in_process({**ONE_SHOT, "strategy": "fedavg", "results-dir": str(tmp_path), "run-name": "run"}, CLIENTS)
    row = _rows(tmp_path / "run")[-1]
    config = _config(strategy="fedavg")
    states, _, dataset, _ = train_clients(config, CLIENTS, same_init=False, device=torch.device("cpu"))
    model = build_run_model(config, dataset)
    scores = score_models(model, [ArrayRecord(s) for s in states], dataset.test_x, dataset.test_y, torch.device("cpu"))
    assert row["server-ensemble"] == pytest.approx(scores.ensemble)
    assert row["server-best-client"] == pytest.approx(max(scores.models))
    assert row["server-client-mean"] == pytest.approx(sum(scores.models) / CLIENTS)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final-server-ensemble"] == row["server-ensemble"]


def test_the_ensemble_is_the_mean_of_the_softmax_outputs_computed_by_hand():
    torch.manual_seed(0)
    x = torch.randn(7, 1, 2, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    models = [build_model("small-mlp", (1, 2, 2), 3, PanSettings()) for _ in range(3)]
    probabilities = [torch.softmax(m.eval()(x), dim=1) for m in models]
    by_hand = ((sum(probabilities) / 3).argmax(dim=1) == y).double().mean().item()
    singles = [(p.argmax(dim=1) == y).double().mean().item() for p in probabilities]
    scores = score_models(models[0], [ArrayRecord(federated_state(m)) for m in models], x, y, torch.device("cpu"))
    assert scores.ensemble == pytest.approx(by_hand) and scores.models == pytest.approx(singles)
    assert scores.metrics()["server-best-client"] == max(singles)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"client-init": "random"}, ["'client-init'", "'random'", "global", "independent"]),
        ({"strategy": "fedper"}, ["'server-ensemble'", "fedper", "personal heads"]),
        ({"strategy": "psinet", "model": "psi-vgg9", "width-factor": 0.25}, ["'server-ensemble'", "psinet"]),
    ],
)
def test_meaningless_combinations_are_refused_before_anything_starts(tmp_path, changes, named):
    values = {**ONE_SHOT, "strategy": "fedavg", **changes, "results-dir": str(tmp_path / "results")}
    with pytest.raises(ConfigError) as refused:
        check_run(parse_run_config(values))
    assert all(part in str(refused.value) for part in named), str(refused.value)
    assert not (tmp_path / "results").exists()


def test_units_moved_needs_a_permutation_description():
    config = _config(strategy="fedavg", **{"log-units-moved": True})
    shape, classes = dataset_info(config.dataset)
    context = build_context(config, build_model_for(config, shape, classes))
    with pytest.raises(ConfigError, match="'log-units-moved'.*no permutation description"):
        ServerStrategy(dataclasses.replace(context, spec=None))


def test_each_round_records_how_many_units_the_clients_training_moved(tmp_path):
    values = {**ONE_SHOT, "strategy": "fedavg", "num-server-rounds": 2, "log-units-moved": True}
    run_in_process({**values, "results-dir": str(tmp_path), "run-name": "run"}, CLIENTS)
    first, second = _rows(tmp_path / "run")[1:]
    assert "client-units-moved" not in first  # round 1's clients started from their own models
    groups = {"hidden.0", "hidden.1", "hidden.2", "hidden.3"}
    assert set(second["client-units-moved"]) == groups == set(first["client-units-moved-between"])
    assert all(0 <= share <= 1 for share in second["client-units-moved"].values())
    assert sum(first["client-units-moved-between"].values()) > 0  # independent starts: apart from one another
    still = {**values, "client-init": "global", "lr": 1e-9, "results-dir": str(tmp_path), "run-name": "still"}
    run_in_process(still, CLIENTS)
    assert all(set(row["client-units-moved"].values()) == {0.0} for row in _rows(tmp_path / "still")[1:])
