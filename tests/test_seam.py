"""The one seam for Flower's and Ray's internals (alignfl/fl_app/patches/seam.py): it lists every internal alignfl
touches, each resolves on the installed Flower, nothing else (the benchmarks included) imports one, and where a release
is unknown or an internal has moved, the launcher, a SuperNode and a SuperExec still start, each with its warning."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignfl.fl_app.patches import seam
from alignfl.fl_app.runtime.common import free_port

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_FLOWER = ("flwr.common", "flwr.app", "flwr.serverapp", "flwr.clientapp")
"""Flower's public API: what these modules export (their ``__all__``, a sub-module they export included, as
``flwr.serverapp.strategy``), and the logger ``flwr.common.logger.log``; anything else goes through the seam."""
PUBLIC_EXTRAS = {"flwr.common.logger": {"log"}}


def public_exports(module: str) -> set[str] | None:
    """What a public Flower module exports (None: the module is not public)."""
    if module in PUBLIC_EXTRAS:
        return PUBLIC_EXTRAS[module]
    parent, _, name = module.rpartition(".")
    if module not in PUBLIC_FLOWER and (parent not in PUBLIC_FLOWER or name not in (public_exports(parent) or ())):
        return None
    return set(importlib.import_module(module).__all__)


def flower_problem(module: str, names: list[str] | None) -> str | None:
    """Why importing ``names`` from a Flower ``module`` (``import module`` where None) leaves the public API."""
    if module == "flwr":
        private = [name for name in names or () if f"flwr.{name}" not in PUBLIC_FLOWER]
        return f"flwr.{','.join(private)}" if private else None
    exports = public_exports(module)
    if exports is None:
        return module
    if names is None:
        return module if module in PUBLIC_EXTRAS else None
    private = [name for name in names if name not in exports]
    return f"{module}.{','.join(private)}" if private else None


def documented_internals() -> list[str]:
    """The first column of the docstring's table."""
    lines = (seam.__doc__ or "").splitlines()
    rules = [index for index, line in enumerate(lines) if line.startswith("=====")]
    width = len(lines[rules[0]].split()[0])
    return [line[:width].strip() for line in lines[rules[1] + 1 : rules[2]] if line[:width].strip()]


def test_the_docstring_table_lists_every_internal_once_and_nothing_else():
    documented = documented_internals()
    assert len(documented) == len(set(documented))
    assert sorted(documented) == sorted(seam.INTERNALS)


def test_every_internal_is_there_as_read_on_the_installed_flower_and_ray():
    """The pinned releases are checked ones, and every name and signature the patches rely on is as read."""
    assert seam.release_problem("flwr") is None and seam.release_problem("ray") is None
    assert seam.problem(*seam.INTERNALS) is None


SCANNED = ("alignfl", "hydra_plugins", "benchmarks")
"""Where nothing but the seam imports an internal: the packages and the benchmarks (tests may: they check
Flower's internals themselves, and ``tests/flower_state.py`` builds Flower's state from them)."""


def sources() -> list[Path]:
    return [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]


def internal_imports(path: Path) -> list[str]:
    """Imports of Flower or Ray modules outside their public API in ``path``, and reads of Ray's private ones."""
    found = []
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text())):
        imports: list[tuple[str, list[str] | None]] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imports = [(node.module, [alias.name for alias in node.names])]
        elif isinstance(node, ast.Import):
            imports = [(alias.name, None) for alias in node.names]
        for module, names in imports:
            top = module.partition(".")[0]
            if top == "flwr":
                problem = flower_problem(module, names)
            else:
                problem = module if top == "ray" and module != "ray" else None
            if problem is not None:
                found.append(f"{label}:{node.lineno}: {problem}")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "ray"
            and node.attr.startswith("_")
        ):
            found.append(f"{label}:{node.lineno}: ray.{node.attr}")
    return found


def test_nothing_but_the_seam_imports_an_internal():
    seam_file = ROOT / "alignfl" / "fl_app" / "patches" / "seam.py"
    scanned = sources()
    found = [line for path in scanned if path != seam_file for line in internal_imports(path)]
    assert len(scanned) > 100 and not found, found
    assert ROOT / "benchmarks" / "benchutil.py" in scanned and ROOT / "benchmarks" / "psinet" / "run.py" in scanned


def test_the_import_scan_sees_an_internal(tmp_path):
    """The check itself: an import of a private module and a read of Ray's private attributes are found."""
    source = tmp_path / "x.py"
    source.write_text("import ray\nfrom flwr.supercore.date import now\nfrom flwr.app import Message\nray._private\n")
    found = [line.split(": ")[1] for line in internal_imports(source)]
    assert found == ["flwr.supercore.date", "ray._private"]


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("from flwr.common.constant import ErrorCode", "flwr.common.constant"),
        ("from flwr.common.serde import recorddict_to_proto", "flwr.common.serde"),
        ("import flwr.common.serde", "flwr.common.serde"),
        ("from flwr.common import serde", "flwr.common.serde"),  # a module flwr.common does not export
        ("from flwr.common.logger import log, update_console_handler", "flwr.common.logger.update_console_handler"),
        ("import flwr.common.logger", "flwr.common.logger"),
        ("from flwr.simulation import run_simulation", "flwr.simulation"),
        ("from flwr.serverapp.strategy.fedavg import FedAvg", "flwr.serverapp.strategy.fedavg"),
        ("from flwr import supercore", "flwr.supercore"),
        ("from flwr.common.logger import log", None),
        ("from flwr.common import Error, log", None),
        ("from flwr.app import ArrayRecord, Message", None),
        ("from flwr.serverapp import Grid, ServerApp", None),
        ("from flwr.serverapp.strategy import FedAvg", None),  # a sub-module flwr.serverapp exports
        ("from flwr.clientapp import ClientApp", None),
        ("import flwr", None),
        ("from flwr_datasets.partitioner import IidPartitioner", None),  # another distribution
    ],
)
def test_public_flower_is_what_its_four_public_modules_export_and_the_logger(line, found, tmp_path):
    source = tmp_path / "x.py"
    source.write_text(line + "\n")
    assert [entry.split(": ")[1] for entry in internal_imports(source)] == ([found] if found else [])


def test_a_flower_command_s_module_is_the_one_its_console_script_imports_it_from():
    module = seam.flower_command_module("flwr-clientapp")
    assert importlib.import_module(module).flwr_clientapp is seam.flower_command("flwr-clientapp")


def test_an_unchecked_release_leaves_flowers_behaviour_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(seam, "release", lambda package: "9.9.9")
    applied = []
    patch = seam.Patch(lost="nothing changes", needs=("flwr.supercore.date.now",))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not seam.install(patch, lambda: applied.append(1))
        assert not seam.install(patch, lambda: applied.append(1))
    assert not applied
    assert caplog.text.count("nothing changes: Flower 9.9.9 is not a release alignfl was checked against") == 1
    assert seam.usable("a read", "flwr.supercore.date.now")  # a read that changes nothing needs no checked release


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"module": "flwr.supercore.date_moved"}, "flwr.supercore.date_moved does not import"),
        ({"name": "later"}, "flwr.supercore.date has no later"),
        ({"parameters": ("tz",)}, "flwr.supercore.date.now has no parameter tz"),
    ],
)
def test_a_moved_or_changed_internal_is_named_in_the_warning(monkeypatch, caplog, change, why):
    key = "flwr.supercore.date.now"
    monkeypatch.setitem(seam.INTERNALS, key, dataclasses.replace(seam.INTERNALS[key], **change))
    with pytest.raises(seam.Unavailable, match=why):
        seam.get(key)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not seam.install(seam.Patch(lost="the clock stays Flower's", needs=(key,)), lambda: None)
    assert f"the clock stays Flower's: {why}" in caplog.text


def test_a_keyword_whose_default_a_patch_changes_must_be_keyword_only_with_a_default(monkeypatch):
    key = "flwr.supercore.tls.validate_and_resolve_root_certificates"
    monkeypatch.setitem(seam.INTERNALS, key, dataclasses.replace(seam.INTERNALS[key], parameters=("*insecure",)))
    with pytest.raises(seam.Unavailable, match=r"has no parameter \*insecure"):
        seam.get(key)


def test_a_replacement_is_undone_and_flowers_own_stays_at_hand(monkeypatch):
    key = "flwr.supercore.date.now"
    flower = seam.get(key)
    seam.replace(key, lambda: "later")
    try:
        assert seam.replaced(key)() == "later" and seam.get(key) is flower
    finally:
        seam.restore(key)
    assert seam.replaced(key) is flower


# --- Flower's processes still start, each with its warning ---

FAULTS = {
    "release": (
        "import importlib.metadata\n"
        "_version = importlib.metadata.version\n"
        "importlib.metadata.version = lambda name: '9.9.9' if name == 'flwr' else _version(name)\n",
        "Flower 9.9.9 is not a release alignfl was checked against",
    ),
    "moved": (
        "import dataclasses\n"
        "from alignfl.fl_app.patches import seam\n"
        "for key, internal in list(seam.INTERNALS.items()):\n"
        "    if key != 'flwr.supercore.task_identity.TaskIdentity':  # the in-process grid cannot do without it\n"
        "        seam.INTERNALS[key] = dataclasses.replace(internal, module=internal.module + '_moved')\n",
        "_moved does not import",
    ),
}
"""What an unknown Flower release and internals that all moved look like, as ``sitecustomize.py`` in every Python
process a test starts (its SuperLink's and simulation's too): the fault, and what its warnings say."""


def faulty_environment(tmp_path: Path, fault: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULTS[fault][0])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_TELEMETRY_ENABLED": "0",
    }


def started(command: list[str], env: dict[str, str], log: Path, expected: list[str], timeout_s: float = 60.0) -> str:
    """Start ``command``, wait until its output holds every ``expected`` line part, stop it; its output."""
    with log.open("w") as stream:
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not all(part in log.read_text() for part in expected):
            assert process.poll() is None, f"{command[2]} exited {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{command[2]} did not start in time:\n{log.read_text()}"
            time.sleep(0.2)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return log.read_text()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_supernode_starts_as_flowers_own_with_the_warning(tmp_path, fault):
    command = [sys.executable, "-m", "alignfl.fl_app.patches.polling_supernode", "--insecure", "--isolation", "process"]
    command += ["--superlink", f"127.0.0.1:{free_port()}", "--port", str(free_port())]
    lost = "the SuperNode polls every 3 s as Flower's own does"
    started(
        command, faulty_environment(tmp_path, fault), tmp_path / "supernode.log", [lost, "Starting Flower SuperNode"]
    )


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_superexec_starts_as_flowers_own_with_the_warning(tmp_path, fault):
    command = [sys.executable, "-m", "alignfl.fl_app.patches.warm_superexec", "--insecure"]
    command += ["--runtime-api-address", f"127.0.0.1:{free_port()}"]
    output = started(
        command,
        faulty_environment(tmp_path, fault),
        tmp_path / "superexec.log",
        ["warm ClientApp processes are off", FAULTS[fault][1], "Starting Flower SuperExec"],
    )
    assert "warm ClientApp parent" not in output


@pytest.mark.long
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_launcher_runs_a_simulation_with_flowers_own_runtime_and_the_warnings(tmp_path, fault):
    """The whole launcher on a faulty Flower (long: a SuperLink, Ray and a simulation for each fault). Cheaper tests
    cover its parts in CI: the simulation's patch refused with its warning and every node asked instead
    (tests/test_flower_runtime.py, both faults), the SuperNode and SuperExec above in their own processes, and the
    round runner asking every node in every deployment (tests/test_deploy_loopback.py)."""
    run_config = f'dataset="digits" num-server-rounds=1 results-dir="{tmp_path}" run-name="run"'
    done = subprocess.run(
        [sys.executable, "-m", "alignfl.fl_app.launch", "--num-supernodes", "2", "--run-config", run_config],
        env=faulty_environment(tmp_path, fault),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert (tmp_path / "run" / "summary.json").is_file()
    for lost in ("simulation keeps its own message lookup", FAULTS[fault][1]):
        assert lost in output, output
