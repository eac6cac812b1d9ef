"""Experiment tracking, read back with the trackers' own readers: TensorBoard's event accumulator and MLflow's
client, on a SQLite store and on a real ``mlflow server`` process; progress lines."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import flwr
import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from alignfl.fl_app.config import ConfigError, parse_run_config, validate_run
from alignfl.fl_app.inprocess import run_in_process
from alignfl.fl_app.progress import RoundProgress, duration, sweep_progress
from alignfl.fl_app.provenance import machine
from alignfl.fl_app.sweeps.tracking import write_hparams
from alignfl.fl_app.tracking import TRACKING_FILE, Tracking, scalars

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "dataset": "digits",
    "model": "small-mlp",
    "num-server-rounds": 2,
    "batch-size": 32,
    "device": "cpu",
    "run-name": "run",
}


def run(results: Path, **values) -> dict:
    return run_in_process({**TINY, "results-dir": str(results), **values}, 2)


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def tensorboard(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return accumulator


def expected_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Every metric of metrics.jsonl as (round, value) pairs, the way a tracker should hold it."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in scalars(row).items():
            series.setdefault(name, []).append((row["round"], value))
    return series


def same_series(got: list[tuple[int, float]], points: list[tuple[int, float]]) -> bool:
    """The same steps, each once and in order, with the same values (TensorBoard keeps float32)."""
    return [step for step, _ in got] == [step for step, _ in points] and [value for _, value in got] == pytest.approx(
        [value for _, value in points], rel=1e-6, nan_ok=True
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_scalars_flatten_every_number_of_a_row():
    row = {
        "round": 3,
        "accuracy": 0.5,
        "units-moved": {"fc1": 0.25, "fc2": 0.0},
        "lambda-accuracy": [0.1, 0.2],
        "clients-trained": 4,
        "resumed": True,
        "note": "text",
        "missing": None,
    }
    assert scalars(row) == {
        "accuracy": 0.5,
        "units-moved/fc1": 0.25,
        "units-moved/fc2": 0.0,
        "lambda-accuracy/0": 0.1,
        "lambda-accuracy/1": 0.2,
        "clients-trained": 4.0,
        "resumed": 1.0,
    }


def test_progress_says_round_elapsed_and_time_left(tmp_path):
    progress = RoundProgress(10, first_round=1, started=time.monotonic() - 30)
    assert progress.describe(3, 42) == "round 3/10, elapsed 42s, about 1m10s left"  # 30 s / 3 rounds x 7 left
    assert RoundProgress(10, first_round=5).describe(4, 7) == "round 4/10, elapsed 7s"  # nothing trained yet
    assert (duration(59.4), duration(3725)) == ("59s", "1h02m")
    assert sweep_progress(2, 1, 4, time.time() - 60) == (
        "sweep: 2 of 4 jobs done (1 failed), 2 left, elapsed 1m00s, about 1m00s left"
    )
    assert sweep_progress(2, 1) == "sweep: 2 jobs done (1 failed)"  # a sweep whose size is not known


def test_tensorboard_is_on_by_default_with_every_round_of_every_metric(tmp_path):
    summary = run(tmp_path)
    folder = Path(summary["run-folder"])
    assert summary["tracking"] == {"tensorboard": "complete"}
    board = tensorboard(folder)
    expected = expected_series(rows_of(folder))
    assert {"accuracy", "loss", "train-loss", "clients-trained", "clients-dropped", "local-accuracy-mean"} <= set(
        expected
    )
    for name, points in expected.items():
        assert same_series([(event.step, event.value) for event in board.Scalars(name)], points), name
    assert board.Scalars("summary/final-accuracy")[0].value == pytest.approx(summary["final-accuracy"])
    (text,) = board.Tensors("run-config/text_summary")
    assert "| num-server-rounds | 2 |" in text.tensor_proto.string_val[0].decode()
    assert json.loads((folder / "summary.json").read_text())["machine"] == summary["machine"] == machine()
    assert f"| machine.cpu | {summary['machine']['cpu']} |" in text.tensor_proto.string_val[0].decode()
    assert not [tag for tag in board.Tags()["scalars"] if tag.startswith("summary/machine")]  # no figure


def test_an_mlflow_run_holds_the_run_and_a_resumed_run_continues_it_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    first = run(tmp_path, tracking="both", **{"mlflow-uri": uri})
    folder = Path(first["run-folder"])
    run_id = first["tracking"]["mlflow-run-id"]
    assert first["tracking"] == {"tensorboard": "complete", "mlflow": "complete", "mlflow-run-id": run_id}
    client = MlflowClient(uri)
    stored = client.get_run(run_id)
    assert stored.info.status == "FINISHED"
    config = json.loads((folder / "config.json").read_text())
    machine = {f"machine.{key}": value for key, value in first["machine"].items()}  # summary.json's, as parameters
    assert stored.data.params == {key: str(value) for key, value in {**config, **machine}.items()}
    assert {key: stored.data.tags[key] for key in ("strategy", "model", "dataset", "partitioner", "seed")} == {
        "strategy": "fedavg",
        "model": "small-mlp",
        "dataset": "digits",
        "partitioner": "dirichlet",
        "seed": "0",
    }
    assert stored.data.tags["flwr-version"] == flwr.__version__ and stored.data.tags["mlflow.source.git.commit"]
    assert stored.data.metrics["final-accuracy"] == pytest.approx(first["final-accuracy"])
    assert {artifact.path for artifact in client.list_artifacts(run_id)} == {
        "accuracy.png",
        "config.json",
        "metrics.jsonl",
        "model.pt",
        "summary.json",
    }
    assert (tmp_path / "store" / "mlflow-artifacts" / run_id / "artifacts" / "model.pt").is_file()  # beside the DB

    resumed = run(
        tmp_path,
        tracking="both",
        **{"mlflow-uri": uri, "resume-from": str(folder), "num-server-rounds": 3, "run-name": ""},
    )
    assert resumed["tracking"]["mlflow-run-id"] == run_id  # the same MLflow run goes on
    assert json.loads((folder / TRACKING_FILE).read_text())["mlflow"]["run-id"] == run_id
    expected = expected_series(rows_of(folder))
    assert [step for step, _ in expected["accuracy"]] == [0, 1, 2, 3]
    board = tensorboard(folder)
    for name, points in expected.items():
        history = sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, name))
        assert same_series(history, points), name  # every round once, in MLflow
        assert same_series([(e.step, e.value) for e in board.Scalars(name)], points), name  # and in TensorBoard


def test_a_resumed_mlflow_run_goes_on_after_its_last_row_when_the_server_did_not_score_that_round(tmp_path):
    """Rows of rounds the server did not evaluate lack ``accuracy``; MLflow still tracks each row once."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = parse_run_config({**TINY, "results-dir": str(tmp_path), "tracking": "mlflow", "mlflow-uri": uri})
    rows = [
        {"round": 0, "accuracy": 0.1, "loss": 2.0, "elapsed-s": 0.5},
        {"round": 1, "elapsed-s": 1.5, "clients-trained": 2},
        {"round": 2, "elapsed-s": 2.5, "clients-trained": 2},
    ]
    first = Tracking.open(config, tmp_path, resumed=False)
    first.log_rows(rows[:2])
    first.close(failed=True)
    resumed = Tracking.open(config, tmp_path, resumed=True)
    resumed.log_rows(rows)
    resumed.close(failed=False)
    client, run_id = MlflowClient(uri), json.loads((tmp_path / TRACKING_FILE).read_text())["mlflow"]["run-id"]
    for name, points in expected_series(rows).items():
        history = sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, name))
        assert same_series(history, points), name


def test_tracking_that_cannot_start_warns_once_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the database's folder should be")
    summary = run(tmp_path, tracking="both", **{"mlflow-uri": f"sqlite:///{blocker / 'mlflow.db'}"})
    assert summary["rounds"] == 2 and len(rows_of(Path(summary["run-folder"]))) == 3  # metrics.jsonl is the record
    assert summary["tracking"]["tensorboard"] == "complete"
    assert summary["tracking"]["mlflow"].startswith("not tracked could not start: ")
    assert json.loads((Path(summary["run-folder"]) / "summary.json").read_text())["tracking"] == summary["tracking"]
    # A server nobody answers on: refused at once, not after MLflow's minutes of retries.
    config = parse_run_config(
        {**TINY, "results-dir": str(tmp_path), "tracking": "mlflow", "mlflow-uri": f"http://127.0.0.1:{free_port()}"}
    )
    started = time.monotonic()
    tracking = Tracking.open(config, tmp_path, resumed=False)
    assert time.monotonic() - started < 10
    assert not tracking.sinks and "Connection refused" in tracking.status()["mlflow"]
    nothing = Tracking.open(parse_run_config({**TINY, "tracking": "none"}), tmp_path, resumed=False)
    assert nothing.sinks == [] and nothing.status() == {}


def test_mlflow_keys_are_checked_and_a_missing_mlflow_is_refused_with_the_install_command(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="'mlflow-uri'.*absolute"):
        parse_run_config({**TINY, "mlflow-uri": "sqlite:///relative.db"})
    with pytest.raises(ConfigError, match="'tracking'.*choose one of"):
        parse_run_config({**TINY, "tracking": "wandb"})
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    config = parse_run_config({**TINY, "results-dir": str(tmp_path), "tracking": "both"})
    with pytest.raises(ConfigError, match=r"'tracking'.*pip install 'alignfl\[mlflow\]'"):
        validate_run(config)
    validate_run(parse_run_config({**TINY, "results-dir": str(tmp_path)}))  # TensorBoard needs no extra


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""An opener that never goes through a proxy (urlopen's own keeps the proxies of its first call in this process)."""


def start_mlflow_server(folder: Path) -> tuple[subprocess.Popen, str]:
    """A real ``mlflow server`` on a free 127.0.0.1 port, once it answers (its log in ``folder``)."""
    port, log = free_port(), folder / "mlflow-server.log"
    with log.open("wb") as stream:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{folder / 'server.db'}",
                "--artifacts-destination",
                str(folder / "server-artifacts"),
            ],
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job runners: alignfl sends none
        )
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while server.poll() is None and time.monotonic() < deadline:
        try:
            DIRECT.open(f"{uri}/health", timeout=2).read()
            return server, uri
        except OSError:
            time.sleep(1)
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    raise AssertionError(f"mlflow server did not answer at {uri}; the end of its log:\n{log.read_text()[-2000:]}")


@pytest.mark.slow
def test_a_sweep_on_a_real_mlflow_server_is_a_parent_with_a_child_per_job(tmp_path):
    server, uri = start_mlflow_server(tmp_path)
    try:
        sweep_dir = tmp_path / "sweep"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "alignfl.fl_app.sweep",
                "-m",
                "dataset=digits",
                "model=small-mlp",
                "sim.num_supernodes=2",
                "train.num_server_rounds=2",
                "sim.backend=inprocess",
                "tracking=both",
                f"mlflow_uri={uri}",
                "train.lr=0.05,0.1",
                f"hydra.sweep.dir={sweep_dir}",
            ],
            cwd=ROOT,
            env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "[alignfl] sweep: 1 of 2 jobs done (0 failed), 1 left" in result.stdout
        assert f"summary: {sweep_dir / 'summary.md'}" in result.stdout

        client = MlflowClient(uri)
        runs = client.search_runs(client.get_experiment_by_name("alignfl").experiment_id)
        (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert parent.info.status == "FINISHED" and parent.data.params["swept.train.lr"] == "0.05,0.1"
        assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"summary.csv", "summary.md"}
        assert sorted(child.data.params["lr"] for child in children) == ["0.05", "0.1"]
        for child in children:
            folder = Path(child.data.tags["run-folder"])
            for name, points in expected_series(rows_of(folder)).items():
                history = sorted((m.step, m.value) for m in client.get_metric_history(child.info.run_id, name))
                assert same_series(history, points), name
            assert "model.pt" in {a.path for a in client.list_artifacts(child.info.run_id)}
            # TensorBoard's HParams: the job's session holds its learning rate and final accuracy.
            board = tensorboard(folder)
            start = plugin_data_pb2.HParamsPluginData.FromString(
                board.PluginTagToContent("hparams")["_hparams_/session_start_info"]
            ).session_start_info
            assert start.hparams["train.lr"].number_value == float(child.data.params["lr"])
            assert board.Scalars("hparams/final-accuracy")[0].value == pytest.approx(
                json.loads((folder / "summary.json").read_text())["final-accuracy"]
            )
        experiment = plugin_data_pb2.HParamsPluginData.FromString(
            tensorboard(sweep_dir).PluginTagToContent("hparams")["_hparams_/experiment"]
        ).experiment
        assert {info.name for info in experiment.hparam_infos} == {"train.lr", "seed"}

        # The server goes away during a run: one warning, tracking off, the summary says so.
        config = parse_run_config({**TINY, "results-dir": str(tmp_path), "tracking": "mlflow", "mlflow-uri": uri})
        (tmp_path / "late").mkdir()
        tracking = Tracking.open(config, tmp_path / "late", resumed=False)
        assert tracking.status()["mlflow"] == "complete"
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        tracking.log_rows([{"round": 0, "accuracy": 0.1}])
        assert tracking.status()["mlflow"].startswith("not tracked from round 0 on: ")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


def test_the_hparams_view_leaves_out_moved_run_folders_and_a_write_failure_is_a_warning(tmp_path, caplog):
    def run_folder(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"tracking": "tensorboard", "seed": 0}))
        return folder

    kept, sweep_dir = run_folder("kept"), tmp_path / "sweep"
    sessions = [
        (kept, {"train.lr": "0.1"}, {"final-accuracy": 0.5}),
        (tmp_path / "moved", {"train.lr": "0.2"}, {"final-accuracy": 0.6}),
    ]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        write_hparams(sweep_dir, sessions)
    assert f"run folder {tmp_path / 'moved'} is gone" in caplog.text
    assert not (tmp_path / "moved").exists()  # not made again by the writer
    assert tensorboard(kept).Scalars("hparams/final-accuracy")[0].value == pytest.approx(0.5)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the sweep folder should be")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        write_hparams(blocked, sessions[:1])  # no exception: the report goes on
    assert "HParams view not written" in caplog.text
