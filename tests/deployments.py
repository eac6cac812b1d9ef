"""What the deployment tests (tests/test_deploy_*.py) share: the services' commands as
alignfl/fl_app/runtime/topology.py builds them, a small run's config, a home folder of the services' own, running a run
to its end on a deployment and reading its metrics."""

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from alignfl.fl_app.runtime.deployment import Deployment
from alignfl.fl_app.runtime.launch import prepare_config
from alignfl.fl_app.runtime.topology import (
    Topology,
    clientapp_executor_command,
    register_command,
    serverapp_executor_command,
    superlink_command,
    supernode_command,
)

RUN_TIMEOUT_S = 900
TINY = {"dataset": "digits", "model": "small-mlp", "num-server-rounds": 2}


def expected_commands(topology: Topology) -> dict[str, list[str]]:
    """Every service's argv as alignfl/fl_app/runtime/topology.py builds it, by compose service name."""
    commands = {"superlink": superlink_command(topology), "superexec-serverapp": serverapp_executor_command(topology)}
    for node in range(topology.num_supernodes):
        commands[f"supernode-{node}"] = supernode_command(topology, node)
        commands[f"superexec-clientapp-{node}"] = clientapp_executor_command(topology, node)
    if topology.certificates is not None:
        commands["supernode-register"] = register_command(topology)
    return commands


def rows(folder: Path) -> list[dict]:
    """metrics.jsonl's complete lines (a line being written is left out)."""
    path = folder / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home folder of their own for the services (their clients keep state under ~/.cache/alignfl), set as
    ``HOME`` until the generator is closed: the body of a module-scoped fixture."""
    folder = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(folder))
        yield folder


QUICK_HEARTBEATS = """\
import sys
if any("supernode" in part for part in sys.orig_argv[:3]):
    import flwr.common.constant as constant
    constant.HEARTBEAT_DEFAULT_INTERVAL = constant.HEARTBEAT_MIN_INTERVAL
"""
"""``sitecustomize.py`` that makes a SuperNode beat at Flower's shortest heartbeat interval, 10 s, instead of its
default 30 s (Flower 1.41, 1.42: ``HEARTBEAT_DEFAULT_INTERVAL``, which the SuperNode sends to its SuperLink and
which no option sets): the SuperLink then marks a dead node offline after 20 s instead of 60 s."""


def quick_heartbeats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SuperNodes started until the generator is closed beat every 10 s (:data:`QUICK_HEARTBEATS`, on their
    ``PYTHONPATH``): the body of a module-scoped fixture, for tests that wait for a killed node to be noticed."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(QUICK_HEARTBEATS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        yield


def run_config(results: Path, name: str, num_supernodes: int, **overrides):
    return prepare_config({**TINY, "results-dir": str(results), "run-name": name, **overrides}, num_supernodes)


def run_to_end(running: Deployment, config) -> tuple[str, str]:
    """The run's final status; a hung run fails the test (stopping the deployment then ends the log stream)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(running.run, config).result(timeout=RUN_TIMEOUT_S)


def without_clock(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed-s"} for r in records]
