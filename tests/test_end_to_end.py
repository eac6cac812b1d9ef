"""End-to-end runs: in-process simulations and the `flwr run` launcher (slow: Ray and a SuperLink start)."""

import json
from pathlib import Path

import pytest
import torch
from flwr.simulation import run_simulation
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.inprocess import run_in_process
from alignfl.fl_app.runtime import launch
from alignfl.fl_app.server_app import build_server_app
from alignfl.models import build_model

pytestmark = pytest.mark.slow

BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch):
    """Clients keep their state under ~/.cache/alignfl (alignfl.fl_app.node_state): these runs keep it in a folder of
    the test's own, which the Flower processes the launcher starts inherit."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


def simulate(results_dir: Path, num_supernodes: int = 3, **overrides) -> Path:
    """Run one in-process simulation on digits; return its run folder."""
    config = {
        "dataset": "digits",
        "num-server-rounds": 2,
        "results-dir": str(results_dir),
        "min-available-nodes": num_supernodes,
        **overrides,
    }
    run_simulation(
        server_app=build_server_app(config),
        client_app=build_client_app(config),
        num_supernodes=num_supernodes,
        backend_config=BACKEND,
    )
    (folder,) = results_dir.iterdir()
    return folder


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long
def test_fedavg_on_digits_learns_and_writes_the_run_folder(tmp_path):
    folder = simulate(tmp_path / "results")
    assert {"config.json", "metrics.jsonl", "summary.json", "accuracy.png", "model.pt"} <= {
        p.name for p in folder.iterdir()
    }
    metrics = rows(folder)
    assert [r["round"] for r in metrics] == [0, 1, 2]
    assert metrics[-1]["clients-trained"] == 3 and metrics[-1]["clients-evaluated"] == 3
    assert set(metrics[-1]["local-accuracy-per-client"]) == {"0", "1", "2"}
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final-accuracy"] == metrics[-1]["accuracy"]
    assert summary["final-accuracy"] > 0.4  # chance is 0.1 on ten classes
    assert json.loads((folder / "config.json").read_text())["dataset"] == "digits"
    model = build_model("mlp", (1, 8, 8), 10)
    model.load_state_dict(torch.load(folder / "model.pt"))  # the saved global model is complete


@pytest.mark.long
def test_same_seed_same_metrics_with_partial_participation(tmp_path):
    """The same seeded run twice gives the same metrics, the sampled clients included: on Flower's Ray simulation
    through its Python API (replies in whatever order the actors finish) and on the in-process engine (one client at
    a time, in order). Long: a sweep job on Flower's runtime checks the same run in CI
    (tests/test_sweep_runs.py::test_an_in_process_job_gives_the_metrics_of_a_ray_job)."""
    settings = {"fraction-train": 0.5, "strategy": "fedprox", "model": "small-mlp", "num-server-rounds": 2}
    first = rows(simulate(tmp_path / "a", num_supernodes=4, **settings))
    run_in_process({"dataset": "digits", "results-dir": str(tmp_path / "b"), **settings}, num_nodes=4)
    (folder,) = (tmp_path / "b").iterdir()
    second = rows(folder)
    for row in first + second:
        row.pop("elapsed-s")
    assert first == second
    assert all(r["clients-trained"] == 2 for r in first[1:])


def test_launcher_runs_flwr_and_reports_success(tmp_path, capfd, fresh_temp):
    code = launch.main(
        [
            "--num-supernodes",
            "2",
            "--run-config",
            f'dataset="digits" num-server-rounds=1 results-dir="{tmp_path}" run-name="ok"',
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["rounds"] == 1
    out = capfd.readouterr().out
    assert "run completed" in out
    assert "| round 1/1, elapsed" in out  # the ServerApp's progress line, streamed to the terminal by the launcher
    board = EventAccumulator(str(tmp_path / "ok"))  # Ray's simulation tracks to TensorBoard as in-process runs do
    board.Reload()
    assert [event.step for event in board.Scalars("accuracy")] == [0, 1]
    assert list(fresh_temp.iterdir()) == []  # Flower's home and Ray's session folder went with the run


def test_launcher_exits_nonzero_when_the_run_fails(tmp_path):
    # Valid keys, so the launcher's pre-checks pass, but an absurd learning rate makes every client's update
    # NaN: each is dropped, and the ServerApp fails the run, after submission, where `flwr run` would exit 0.
    code = launch.main(
        [
            "--num-supernodes",
            "1",  # one Ray actor is enough to fail
            "--run-config",
            f'dataset="digits" lr=1e30 num-server-rounds=1 results-dir="{tmp_path}" run-name="bad"',
        ]
    )
    assert code == 1


def test_launcher_refuses_bad_config_before_starting(tmp_path, capsys):
    code = launch.main(["--num-supernodes", "2", "--run-config", f'dirichlet-alpha=-1 results-dir="{tmp_path}"'])
    assert code == 2
    assert "'dirichlet-alpha'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
