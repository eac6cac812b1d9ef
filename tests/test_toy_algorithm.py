"""Adding an algorithm is one file: :data:`TOY`, a toy algorithm with one setting, registered by its last line.

Fast: loaded as the module ``alignfl.strategies.halfway``, it runs through the run config `flwr run` passes, a Hydra
override and an in-process simulation, and the launcher, deploy and the sweep refuse it, naming its key, until
``pyproject.toml`` has that key. Slow: the file is dropped into ``alignfl/strategies/`` of a copy of the project (the
checkout stays as it is), ``python -m alignfl.fl_app.config --write`` regenerates the copy's ``pyproject.toml``, README
method table and ``docs/configuration.md``, and the copy's launcher and a sweep run it (its deployment: long)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from alignfl.fl_app.config import REGENERATE, ConfigError, default_run_config, parse_run_config, tables, write_pyproject
from alignfl.fl_app.inprocess import run_in_process
from alignfl.fl_app.runtime import deploy, launch
from alignfl.fl_app.runtime.launch import prepare_config
from alignfl.fl_app.sweeps import sweep
from alignfl.fl_app.sweeps.sweep import hydra_to_run_config, register_configs
from alignfl.strategies.registry import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

TOY = '''"""Halfway: FedAvg that moves the global model only part of the way to the clients' mean."""

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from alignfl.core.rounds.strategy import Merge, Reply, ServerStrategy, weighted_mean
from alignfl.plugins.options import option, unit_interval
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class HalfwaySettings:
    halfway_step: float = option(
        0.5, "share of the way from the global model to the clients' mean", unit_interval, "must lie in (0, 1]"
    )


class Halfway(ServerStrategy):
    """FedAvg that moves the global model only ``halfway-step`` of the way to the clients' mean."""

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        mean, step = weighted_mean(replies), self.settings.halfway_step
        moved = {key: x.numpy() + step * (mean[key].numpy() - x.numpy()) for key, x in reference.items()}
        return Merge(ArrayRecord({key: Array(np.asarray(value)) for key, value in moved.items()}))


STRATEGIES.register(Algorithm("halfway", Halfway, LocalUpdate, "FedAvg, half a step", HalfwaySettings))
'''
"""``alignfl/strategies/halfway.py``: the one file."""


@pytest.fixture()
def halfway(tmp_path):
    """:data:`TOY` imported as ``alignfl.strategies.halfway`` for the test only, so the shipped registry (and
    pyproject.toml's keys) stay as they are; returns the module."""
    path = tmp_path / "halfway.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("alignfl.strategies.halfway", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del STRATEGIES._entries["halfway"]
    del sys.modules[spec.name]


def test_the_flwr_run_config_takes_its_key(halfway):
    values = {**default_run_config(), "strategy": "halfway", "halfway-step": 0.25}
    assert parse_run_config(values).settings == halfway.HalfwaySettings(0.25)
    with pytest.raises(ConfigError, match="'halfway-step' = 2.0 is not allowed: must lie in \\(0, 1\\]"):
        parse_run_config({"strategy": "halfway", "halfway-step": 2.0})
    with pytest.raises(ConfigError, match="belongs to strategy 'halfway'"):
        parse_run_config({"strategy": "fedavg", "halfway-step": 0.25})


def test_a_hydra_override_sets_it(halfway):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=halfway", "strategy.halfway_step=0.75"], return_hydra_config=True)
    values = hydra_to_run_config(cfg, cfg.hydra.runtime.choices)
    assert parse_run_config(values).settings == halfway.HalfwaySettings(0.75)


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
SWEEP_ARGS = ["alignfl.fl_app.sweep", "strategy=halfway", "strategy.halfway_step=0.25"]


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
    pyproject.write_text(tables.PYPROJECT.read_text())
    assert write_pyproject(pyproject)  # what `python -m alignfl.fl_app.config --write` does to the real one
    assert "halfway-step = 0.5" in pyproject.read_text()
    monkeypatch.setattr(tables, "PYPROJECT", pyproject)
    config = prepare_config(
        {"strategy": "halfway", "halfway-step": 0.25, "dataset": "digits", "results-dir": str(tmp_path)}, 2
    )
    assert config.settings == halfway.HalfwaySettings(0.25)  # the launcher's and deploy's validation
    monkeypatch.setattr("sys.argv", SWEEP_ARGS)
    sweep.main()
    assert nothing_starts == ["sweep"]


# --- the file dropped into a copy of the project (slow: the launcher, a sweep; long: a deployment) ---

GENERATED = ("pyproject.toml", "README.md", "docs/configuration.md")
OWN_RUN = 'strategy="halfway" halfway-step=0.5 dataset="digits" model="small-mlp" num-server-rounds=1'


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the project with :data:`TOY` as ``alignfl/strategies/halfway.py`` and its tables regenerated."""
    before = {name: (ROOT / name).read_text() for name in GENERATED}
    copy = tmp_path_factory.mktemp("project") / "alignfl"
    caches = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*_cache", "results", "outputs", "multirun")
    shutil.copytree(ROOT, copy, ignore=caches)
    (copy / "alignfl" / "strategies" / "halfway.py").write_text(TOY)
    written = _python(copy, "-m", "alignfl.fl_app.config", "--write")
    assert written.returncode == 0, written.stderr
    assert all(f"{name} updated" in written.stdout for name in GENERATED), written.stdout
    assert {name: (ROOT / name).read_text() for name in GENERATED} == before  # the checkout stays as it was
    return copy


def _python(project: Path, *arguments: str, home: Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGUMENTS`` in ``project``, importing that copy's packages (and Flower's processes with it)."""
    env = {**os.environ, "PYTHONPATH": str(project), "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    if home is not None:
        env["HOME"] = str(home)  # the clients' state (~/.cache/alignfl) and Hydra's default folders
    return subprocess.run(
        [sys.executable, *arguments], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )


def _summary(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    assert (config["strategy"], config["halfway-step"]) == ("halfway", 0.5)
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.slow
def test_regenerating_adds_its_key_and_row_everywhere(project):
    assert "\nhalfway-step = 0.5\n" in (project / "pyproject.toml").read_text()
    assert "| `halfway` | FedAvg, half a step | - |" in (project / "README.md").read_text()
    page = (project / "docs" / "configuration.md").read_text()
    assert "`strategy=halfway`:" in page and "| `halfway-step` | `0.5` |" in page and "`halfway`" in page
    assert "halfway-step" not in (ROOT / "pyproject.toml").read_text()
    assert _python(project, "-m", "alignfl.fl_app.config", "--check").returncode == 0


@pytest.mark.slow
def test_the_launcher_runs_it(project, tmp_path):
    """On the batched engine in the launcher's process: Flower's runtime loading the file from the project's FAB is
    the deployment's test below."""
    results = f'results-dir="{tmp_path}" run-name="launch"'
    launch = ["-m", "alignfl.fl_app.launch", "--backend", "batched", "--num-supernodes", "2"]
    run = _python(project, *launch, "--run-config", f"{OWN_RUN} {results}", home=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _summary(tmp_path / "launch")["rounds"] == 1


@pytest.mark.long
def test_a_deployment_runs_it(project, tmp_path):
    """Long (a deployment of the copy, ~40-70 s here): in CI its parts are cheaper tests' -- the FAB holds every
    file of the package as `flwr build` makes it (tests/test_flwr_cli.py), a module dropped into the package
    registers itself when imported (tests/test_registry.py), the run config `flwr run` passes reaches the toy's
    settings (above), and deployments run what their FAB holds (tests/test_deploy_loopback.py)."""
    results = f'results-dir="{tmp_path}" run-name="deploy"'
    run = _python(
        project,
        "-m",
        "alignfl.fl_app.deploy",
        "--num-supernodes",
        "2",
        "--run-config",
        f"{OWN_RUN} {results}",
        home=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _summary(tmp_path / "deploy")["rounds"] == 1


@pytest.mark.slow
def test_a_sweep_runs_it(project, tmp_path):
    overrides = ["strategy=halfway", "strategy.halfway_step=0.5", "dataset=digits", "model=small-mlp"]
    sim = ["train.num_server_rounds=1", "sim.num_supernodes=2", "sim.backend=inprocess", f"hydra.run.dir={tmp_path}"]
    run = _python(project, "-m", "alignfl.fl_app.sweep", *overrides, *sim, home=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _summary(tmp_path / "run")["rounds"] == 1
