"""alignfl installed from its wheel, away from the checkout: the console script, the package data, and the folders a
run may write to.

The end-to-end test builds the wheel (``pip wheel --no-build-isolation``: hatchling comes with the dev extras, so no
network), installs it without dependencies into a fresh virtual environment whose only other import path is this
test environment's site-packages (named by a ``.pth`` file, so that the ``.pth`` files in there, the editable
checkout's among them, are not read), and from an empty folder runs a round of the batched engine, a sweep job
and a one-shot merge with the ``alignfl`` console script.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from alignfl.fl_app import cli, locations
from alignfl.fl_app.config import ConfigError, parse_run_config
from alignfl.fl_app.runtime import deployment
from alignfl.fl_app.runtime.deployment import resume_command
from alignfl.fl_app.runtime.launch import prepare_config

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"alignfl", "hydra_plugins"}
"""The import names the wheel installs: the project's one namespace, and its launcher in Hydra's plugin namespace."""
RUN_CONFIG = 'dataset="digits" model="small-mlp" num-server-rounds=1 run-name="round"'


# --- the folders a run may write to, and the console script (fast) ---


@pytest.mark.parametrize(
    "inside", [Path(sysconfig.get_paths()["purelib"]) / "alignfl-results", locations.PACKAGE_FOLDER / "results"]
)
def test_a_results_dir_among_the_installed_code_is_refused_before_anything_starts(inside):
    with pytest.raises(ConfigError, match="results-dir") as refused:
        prepare_config({"dataset": "digits", "results-dir": str(inside)}, num_supernodes=2)
    assert "a folder of your own" in str(refused.value) and "lies inside" in str(refused.value)
    assert not inside.exists()


def test_a_folder_of_ones_own_is_not_refused_and_a_relative_one_lies_under_the_current_folder(tmp_path, monkeypatch):
    assert locations.own_folder_problem(tmp_path / "results") is None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the partition cache's
    config = prepare_config({"dataset": "digits", "results-dir": "results", "data-root": ""}, num_supernodes=2)
    assert config.results_dir == str(tmp_path / "results") and config.data_root == ""


def test_the_console_script_lists_every_command_and_hands_the_rest_to_it(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets it for the main it calls
    with pytest.raises(SystemExit) as listed:
        cli.main(["--help"])
    assert listed.value.code == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in ("run", "sweep", "merge", "deploy", "analysis", "report"))
    with pytest.raises(SystemExit) as helped:
        cli.main(["merge", "--help"])
    assert helped.value.code == 0
    assert "usage: alignfl merge [-h]" in capsys.readouterr().out  # the merge tool's own help, as it was called
    for name in ("run", "deploy", "report", "config", "analysis"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        assert f"usage: alignfl {name} " in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    assert locations.program("alignfl.fl_app.launch") == "python -m alignfl.fl_app.launch"  # the python -m form


def test_an_installed_deployment_names_the_console_script_to_resume_with(tmp_path, monkeypatch):
    config = parse_run_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"})
    assert resume_command(config, 2, tls=False).startswith(str(ROOT / "scripts" / "deploy.sh"))  # the checkout's
    monkeypatch.setattr(deployment, "checkout_root", lambda: None)
    assert shlex.split(resume_command(config, 2, tls=False))[:4] == ["alignfl", "deploy", "--num-supernodes", "2"]


def test_the_wheel_ships_every_file_the_commands_read():
    forced = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert forced["force-include"] == {name: f"alignfl/{name}" for name in locations.SHIPPED}


# --- the wheel in a fresh virtual environment (slow: builds, installs, trains) ---


@dataclass(frozen=True)
class Installed:
    """The wheel built from the checkout, and the virtual environment it is installed in."""

    wheel: Path
    python: Path
    site_packages: Path

    @property
    def scripts(self) -> Path:
        return self.python.parent


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` with its output captured; a failure shows the end of it."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """Build the wheel, make a virtual environment that reuses this one's dependencies but not the checkout, and
    install the wheel into it (``--no-deps``, ``--ignore-installed``: the editable alignfl seen through the
    ``.pth`` file is neither reused nor uninstalled)."""
    folder = tmp_path_factory.mktemp("wheel")
    quiet = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    run([*build, "-w", str(folder / "dist"), str(ROOT)], folder, quiet)
    (wheel,) = (folder / "dist").glob("alignfl-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], folder)
    python = folder / "venv" / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], folder)
    site_packages = Path(purelib.stdout.strip())
    (site_packages / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q"]
    run([*install, str(wheel)], folder, quiet)
    return Installed(wheel, python, site_packages)


def user_environment(installed: Installed, home: Path) -> dict[str, str]:
    """What a user's shell would give the installed commands: its scripts first on PATH, a home of its own (the
    data and partition caches), nothing that points Python or the results at the checkout."""
    env = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "ALIGNFL_RESULTS")
    }
    path = f"{installed.scripts}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PATH": path, "HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}


def package_files(site_packages: Path) -> dict[str, tuple[int, int]]:
    """Every file the environment's site-packages holds, with its size and modification time; Python's own byte-code
    caches left out (pip compiled them at install, and they are the interpreter's, not alignfl's)."""
    return {
        str(path.relative_to(site_packages)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in site_packages.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.mark.slow
def test_the_wheel_installs_one_namespace_the_package_data_and_the_console_script(installed):
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == TOP_LEVEL, f"the wheel installs {sorted(top_level)}, not {sorted(TOP_LEVEL)}"
    assert "alignfl/conf/config.yaml" in names and "alignfl/pyproject.toml" in names
    assert f"alignfl = {cli.__name__}:main" in scripts and (installed.scripts / "alignfl").is_file()


@pytest.mark.slow
def test_the_installed_alignfl_runs_from_an_empty_folder_and_writes_only_there(installed, tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = user_environment(installed, home)
    probe = f"import sys, {cli.__name__} as cli; print(cli.__file__); print('\\n'.join(sys.path))"
    seen = run([str(installed.python), "-c", probe], work, env).stdout.splitlines()
    assert Path(seen[0]).is_relative_to(installed.site_packages)  # the wheel's code, not the checkout's
    assert all(Path(entry or work).resolve() != ROOT for entry in seen[1:])
    before = package_files(installed.site_packages)
    alignfl = str(installed.scripts / "alignfl")

    results = 'results-dir="results"'  # relative: under the current folder
    finished = run(
        [alignfl, "run", "--backend", "batched", "--num-supernodes", "2", "--run-config", f"{RUN_CONFIG} {results}"],
        work,
        env,
    )
    assert "run completed" in finished.stdout
    sweep = ["dataset=digits", "model=small-mlp", "train.num_server_rounds=1", "sim.num_supernodes=2"]
    run([alignfl, "sweep", *sweep, "hydra.run.dir=sweep-job"], work, env)  # relative: under the current folder
    run(
        [alignfl, "merge", "--clients", "2", "--epochs", "1", "--costs", "weight", "--out", str(work / "merge")],
        work,
        env,
    )
    assert "usage: alignfl merge [-h]" in run([alignfl, "merge", "--help"], work, env).stdout

    assert (work / "results" / "round" / "summary.json").is_file()
    assert (work / "sweep-job" / "run" / "summary.json").is_file()
    assert (work / "merge" / "merge.json").is_file()
    assert sorted(path.name for path in work.iterdir()) == ["merge", "results", "sweep-job"]  # nothing stray
    assert package_files(installed.site_packages) == before


def link_flower_scripts(installed: Installed) -> None:
    """Flower's commands (``flower-superlink``, ``flwr-serverapp``, ...) in the environment's scripts folder, run by
    its Python, as installing Flower there would make them: the launcher finds them on PATH."""
    flower = importlib.metadata.distribution("flwr")
    for entry in flower.entry_points.select(group="console_scripts"):
        script = installed.scripts / entry.name
        script.write_text(
            f"#!{installed.python}\nimport sys\nfrom {entry.module} import {entry.attr}\nsys.exit({entry.attr}())\n"
        )
        script.chmod(0o755)


@pytest.mark.long
def test_the_installed_alignfl_runs_flwr_run_from_an_empty_folder(installed, tmp_path):
    """Flower's own engine: the launcher stages the installed package's manifest for ``flwr run`` in a temporary
    folder, and Flower's processes import the installed code (long: a SuperLink and Ray start)."""
    link_flower_scripts(installed)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = user_environment(installed, home)
    before = package_files(installed.site_packages)
    results = f'results-dir="{work / "results"}"'
    command = [str(installed.scripts / "alignfl"), "run", "--num-supernodes", "2", "--run-config"]
    finished = run([*command, f"{RUN_CONFIG} {results}"], work, env)
    assert "run completed" in finished.stdout
    assert (work / "results" / "round" / "summary.json").is_file()
    assert package_files(installed.site_packages) == before
