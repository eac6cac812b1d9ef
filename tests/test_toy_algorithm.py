"""Adding an algorithm touches one file: this one. It declares a toy algorithm with one setting, registers it with
one line, and runs it through the run config `flwr run` passes, a Hydra override and an in-process simulation. The
launcher, deploy and the sweep refuse it, naming its key, until `python -m fl_app.config --write` has added that key
to pyproject.toml (`flwr run` refuses a key the table lacks, naming none)."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from hydra import compose, initialize_config_dir

from core.strategy import Reply, ServerStrategy, weighted_mean
from fl_app import config as fl_config
from fl_app.config import REGENERATE, ConfigError, default_run_config, parse_run_config, write_pyproject
from fl_app.inprocess import run_in_process
from fl_app.runtime import deploy, launch
from fl_app.runtime.launch import prepare_config
from fl_app.sweeps import sweep
from fl_app.sweeps.sweep import hydra_to_run_config, register_configs
from plugins.options import option, unit_interval
from strategies.base import LocalUpdate
from strategies.registry import STRATEGIES, Algorithm

CONF = Path(__file__).resolve().parents[1] / "conf"


@dataclass(frozen=True)
class HalfwaySettings:
    halfway_step: float = option(
        0.5, "share of the way from the global model to the clients' mean", unit_interval, "must lie in (0, 1]"
    )


class Halfway(ServerStrategy):
    """FedAvg that moves the global model only ``halfway-step`` of the way to the clients' mean."""

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> ArrayRecord | None:
        mean, step = weighted_mean(replies), self.settings.halfway_step
        return ArrayRecord(
            {key: Array(np.asarray(x.numpy() + step * (mean[key].numpy() - x.numpy()))) for key, x in reference.items()}
        )


@pytest.fixture()
def halfway():
    """Registered for the test only, so the shipped registry (and pyproject.toml's keys) stay as they are."""
    STRATEGIES.register(Algorithm("halfway", Halfway, LocalUpdate, "FedAvg, half a step", HalfwaySettings))
    yield
    del STRATEGIES._entries["halfway"]


def test_the_flwr_run_config_takes_its_key(halfway):
    values = {**default_run_config(), "strategy": "halfway", "halfway-step": 0.25}
    assert parse_run_config(values).settings == HalfwaySettings(0.25)
    with pytest.raises(ConfigError, match="'halfway-step' = 2.0 is not allowed: must lie in \\(0, 1\\]"):
        parse_run_config({"strategy": "halfway", "halfway-step": 2.0})
    with pytest.raises(ConfigError, match="belongs to strategy 'halfway'"):
        parse_run_config({"strategy": "fedavg", "halfway-step": 0.25})


def test_a_hydra_override_sets_it(halfway):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=halfway", "strategy.halfway_step=0.75"], return_hydra_config=True)
    values = hydra_to_run_config(cfg, cfg.hydra.runtime.choices)
    assert parse_run_config(values).settings == HalfwaySettings(0.75)


def test_an_in_process_simulation_runs_it(tmp_path, halfway):
    common = {
        "dataset": "digits",
        "model": "small-mlp",
        "num-server-rounds": 2,
        "device": "cpu",
        "results-dir": str(tmp_path),
    }
    full = run_in_process({**common, "strategy": "halfway", "halfway-step": 1.0, "run-name": "full"}, 2)
    fedavg = run_in_process({**common, "strategy": "fedavg", "run-name": "fedavg"}, 2)
    half = run_in_process({**common, "strategy": "halfway", "halfway-step": 0.5, "run-name": "half"}, 2)
    assert full["final-accuracy"] == fedavg["final-accuracy"]  # a full step is FedAvg
    assert half["final-accuracy"] != fedavg["final-accuracy"]


RUN_CONFIG = 'strategy="halfway" halfway-step=0.25 dataset="digits"'
SWEEP_ARGS = ["fl_app.sweeps.sweep", "strategy=halfway", "strategy.halfway_step=0.25"]


@pytest.fixture()
def nothing_starts(monkeypatch):
    """What each entry point would start after its checks, replaced by a note that it was reached."""
    reached = []
    monkeypatch.setattr(launch, "run_on_local_superlink", lambda config, args: reached.append("launch"))
    monkeypatch.setattr(deploy, "deploy_and_run", lambda config, args: reached.append("deploy"))
    monkeypatch.setattr(sweep, "hydra_main", lambda: reached.append("sweep"))
    return reached


def _exit_code(entry_point: str, monkeypatch) -> int:
    if entry_point == "launch":
        return launch.main(["--num-supernodes", "2", "--run-config", RUN_CONFIG])
    if entry_point == "deploy":
        return deploy.main(["--num-supernodes", "2", "--run-config", RUN_CONFIG])
    monkeypatch.setattr("sys.argv", SWEEP_ARGS)
    with pytest.raises(SystemExit) as exited:
        sweep.main()
    return exited.value.code


@pytest.mark.parametrize("entry_point", ["launch", "deploy", "sweep"])
def test_every_entry_point_refuses_it_until_pyproject_has_its_key(
    halfway, nothing_starts, entry_point, monkeypatch, capsys
):
    """The shipped pyproject.toml lacks `halfway-step`: refused before anything starts, naming the key and the
    command that adds it."""
    assert _exit_code(entry_point, monkeypatch) == 2
    error = capsys.readouterr().err
    assert "refused before starting" in error and "'halfway-step'" in error and REGENERATE in error
    assert nothing_starts == []


def test_the_entry_points_take_it_once_pyproject_has_its_key(halfway, nothing_starts, tmp_path, monkeypatch):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(fl_config.PYPROJECT.read_text())
    assert write_pyproject(pyproject)  # what `python -m fl_app.config --write` does to the real one
    assert "halfway-step = 0.5" in pyproject.read_text()
    monkeypatch.setattr(fl_config, "PYPROJECT", pyproject)
    config = prepare_config(
        {"strategy": "halfway", "halfway-step": 0.25, "dataset": "digits", "results-dir": str(tmp_path)}, 2
    )
    assert config.settings == HalfwaySettings(0.25)  # the launcher's and deploy's validation
    monkeypatch.setattr("sys.argv", SWEEP_ARGS)
    sweep.main()
    assert nothing_starts == ["sweep"]
