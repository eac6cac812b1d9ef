"""The batched engine gives the rounds the other engines give, for every algorithm; faults keep their meaning.

The comparison is with the in-process engine, whose rows equal Flower's Ray simulation's
(tests/test_sweep.py::test_an_in_process_job_gives_the_metrics_of_a_ray_job): running Ray once per
algorithm would cost CI minutes, and the batched engine on Ray workers is compared once below (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignfl.core.config import RunConfig
from alignfl.fl_app.config import ConfigError, check_run, parse_run_config
from alignfl.fl_app.engines import worker as worker_module
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models.registry import option_names
from alignfl.strategies import list_strategies

MODEL_OF = {"psinet": "psi-vgg9"}
"""The model each algorithm is compared on (``small-mlp`` unless it needs another)."""


def _values(strategy: str, tmp_path: Path, name: str) -> dict:
    model = MODEL_OF.get(strategy, "small-mlp")
    values = {
        "strategy": strategy,
        "model": model,
        "dataset": "digits",
        "device": "cpu",
        "num-server-rounds": 2,
        "batch-size": 16,
        "data-fraction": 0.3,
        "fraction-train": 0.75,
        "momentum": 0.5,
        "results-dir": str(tmp_path),
        "run-name": name,
    }
    if "width_factor" in option_names(model):
        values["width-factor"] = 0.25
    return values


def _rows(tmp_path: Path, name: str) -> list[dict]:
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed-s"} for line in lines]


@pytest.mark.parametrize("strategy", list_strategies())
def test_every_algorithm_gives_the_in_process_engines_rows_on_the_batched_engine(strategy, tmp_path):
    values = _values(strategy, tmp_path, "inprocess")
    try:
        check_run(parse_run_config(values))
    except ConfigError as error:  # pragma: no cover - a new algorithm needs an entry in MODEL_OF
        pytest.fail(f"{strategy} needs a model in MODEL_OF: {error}")
    run_in_process(values, 4)
    run_batched({**values, "run-name": "batched"}, 4, vectorise="off")
    expected, got = _rows(tmp_path, "inprocess"), _rows(tmp_path, "batched")
    assert len(expected) == 3 and got == expected


@pytest.mark.parametrize("vectorise", ["off", "on"])
def test_a_client_that_raises_is_dropped_with_its_reason_and_the_others_train(vectorise, tmp_path, monkeypatch):
    original = worker_module.Worker.data

    def failing(self, config: RunConfig, partition_id: int, num_partitions: int):
        if partition_id == 2:
            raise OSError("the disk holding partition 2 is gone")
        return original(self, config, partition_id, num_partitions)

    monkeypatch.setattr(worker_module.Worker, "data", failing)
    values = {**_values("fedavg", tmp_path, "faulty"), "fraction-train": 1.0}
    run_batched(values, 4, vectorise=vectorise)
    rows = _rows(tmp_path, "faulty")
    for row in rows[1:]:
        assert row["clients-trained"] == 3 and row["clients-dropped"] == 1
        (reason,) = row["clients-dropped-reasons"].values()
        assert "OSError: the disk holding partition 2 is gone" in reason
        assert list(row["clients-dropped-reasons"]) == ["2"]


@pytest.mark.slow
def test_ray_workers_give_the_in_process_workers_rows(tmp_path):
    from alignfl.fl_app.engines.grid import RayOptions

    values = _values("scaffold", tmp_path, "inprocess")
    run_batched(values, 6, vectorise="off")
    run_batched({**values, "run-name": "ray"}, 6, vectorise="off", ray=RayOptions(num_cpus=2))
    assert _rows(tmp_path, "ray") == _rows(tmp_path, "inprocess")


def test_sweep_jobs_on_the_batched_engine_give_the_in_process_rows(tmp_path):
    from alignfl.fl_app.sweeps.sweep import register_configs, run_job
    from tests.sweep_jobs import TINY, composed

    register_configs()
    rows = {}
    for backend in ("inprocess", "batched"):  # stacked updates round otherwise: test_vectorised.py bounds that
        sim = [f"sim.backend={backend}", "sim.vectorise=off"]
        cfg = composed([*TINY, "train.num_server_rounds=2", "sim.num_supernodes=4", *sim])
        record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path / backend)
        assert record["status"] == "completed", record["error"]
        lines = (Path(record["run-folder"]) / "metrics.jsonl").read_text().splitlines()
        rows[backend] = [{k: v for k, v in json.loads(line).items() if k != "elapsed-s"} for line in lines]
    assert rows["batched"] == rows["inprocess"] and len(rows["batched"]) == 3


def test_the_batched_engines_sim_settings_are_checked():
    from alignfl.fl_app.sweeps.sim import SimSettings

    assert SimSettings.from_config({"backend": "batched", "workers": 2, "vectorise": "off"}).workers == 2
    assert SimSettings.from_config({"workers": 2}).backend == "batched"  # the sweeps' default engine
    with pytest.raises(ConfigError, match="sim.workers = 2 needs sim.backend=batched, got 'ray'"):
        SimSettings.from_config({"backend": "ray", "workers": 2})
    match = r"'sim.vectorise' = 'yes' is not allowed: choose one of \['auto', 'on', 'off'\]"
    with pytest.raises(ConfigError, match=match):
        SimSettings.from_config({"vectorise": "yes"})
    assert SimSettings.from_config({"backend": "batched", "ray_address": "10.0.0.1:6379"}).ray_address


def test_the_launcher_runs_the_batched_engine_without_a_superlink(tmp_path, capsys):
    from alignfl.fl_app.runtime import launch

    overrides = f'dataset="digits" num-server-rounds=1 results-dir="{tmp_path}" run-name="b" tracking="none"'
    assert launch.main(["--backend", "batched", "--num-supernodes", "3", "--run-config", overrides]) == 0
    assert "run completed" in capsys.readouterr().out and (tmp_path / "b" / "summary.json").exists()
    with pytest.raises(SystemExit):
        launch.main(["--workers", "2"])
    assert "--workers needs --backend batched" in capsys.readouterr().err
