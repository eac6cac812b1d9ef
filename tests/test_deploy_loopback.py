"""The loopback deployment (slow): docker-compose.yml's services as real processes on 127.0.0.1, one deployment of
3 SuperNodes shared by the module: it runs exactly the compose services, FedAvg completes a round across them
(SCAFFOLD two, long), the warm executor gives Flower's own results bit for bit, the SuperLink killed mid-run is
reported and the printed command resumes the run (long), and a SuperNode killed mid-run leaves the run to finish
with every default."""

import json
import shlex
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from alignfl.fl_app.checkpoint import CHECKPOINT, run_folder
from alignfl.fl_app.config import RunConfig
from alignfl.fl_app.provenance import checkout_commit
from alignfl.fl_app.runtime import deploy
from alignfl.fl_app.runtime.deployment import Deployment, deployment, resume_command
from alignfl.fl_app.runtime.launch import report_outcome
from alignfl.fl_app.runtime.superlink import wait_until
from alignfl.fl_app.runtime.topology import loopback_topology
from tests.deployments import (
    RUN_TIMEOUT_S,
    expected_commands,
    private_home,
    quick_heartbeats,
    rows,
    run_config,
    run_to_end,
    without_clock,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""

ONE_FEDAVG_ROUND = {"strategy": "fedavg", "num-server-rounds": 1}
"""The run the strategy check and the comparison of executors read: one round shows both."""


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Iterator[Path]:
    """A home folder of their own for the services: their clients keep state under ~/.cache/alignfl."""
    yield from private_home(tmp_path_factory)


@pytest.fixture(scope="module")
def heartbeats(tmp_path_factory) -> Iterator[None]:
    """The module's SuperNodes beat every 10 s, so the SuperLink notices the one killed within 20 s."""
    yield from quick_heartbeats(tmp_path_factory)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, home, heartbeats) -> Iterator[Deployment]:
    """One plaintext deployment of 3 SuperNodes shared by the tests below (beating every 10 s: :func:`heartbeats`);
    the node-killing test is the last to run on it."""
    work = tmp_path_factory.mktemp("deploy")
    with deployment(loopback_topology(3, work), work) as running:
        yield running


@pytest.fixture(scope="module")
def fedavg_run(plain, tmp_path_factory) -> tuple[RunConfig, str, str, str]:
    """FedAvg, 1 round, on the shared deployment (the warm executor, the default), run once for the tests that
    read it (the strategy check and the comparison with Flower's executor): its config, final status and details,
    and the end of node 0's executor log right after it."""
    config = run_config(tmp_path_factory.mktemp("fedavg"), "fedavg", 3, **ONE_FEDAVG_ROUND)
    status, details = run_to_end(plain, config)
    return config, status, details, plain.log_tail("superexec-clientapp-0", 200)


@pytest.fixture(scope="module")
def flower_executor_run(tmp_path_factory, home) -> Iterator[Future]:
    """The FedAvg run of :func:`fedavg_run` on a deployment of its own whose SuperNodes start a fresh
    flwr-clientapp per message (Flower's executor), started in the background: a future of node 0's executor
    command, the run's final status and its folder. Mostly process start-ups; the node-killing test starts it
    while its SuperLink idles, waiting for a dead node's heartbeats."""
    work, results = tmp_path_factory.mktemp("flower"), tmp_path_factory.mktemp("own")
    started: list[Deployment] = []

    def run() -> tuple[str, str, Path]:
        with deployment(loopback_topology(3, work, executor="flower"), work) as running:
            started.append(running)
            status, _ = running.run(run_config(results, "own", 3, **ONE_FEDAVG_ROUND))
            return running.services["superexec-clientapp-0"].process.args[0], status, results / "own"

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run)
        try:
            yield future
            future.result(timeout=RUN_TIMEOUT_S)
        finally:
            for running in started:  # a hung run: stopping its deployment ends its log stream
                if not future.done():
                    running.stop()


@pytest.mark.slow
def test_loopback_runs_exactly_the_compose_services(plain):
    assert {name: tree.process.args for name, tree in plain.services.items()} == expected_commands(plain.topology)
    assert list(plain.services)[:2] == ["superlink", "superexec-serverapp"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedavg", pytest.param("scaffold", marks=pytest.mark.long)])
def test_strategy_completes_its_rounds_on_three_supernodes(plain, strategy, request, tmp_path, capsys):
    if strategy == "fedavg":  # the run the comparison with Flower's executor reads too
        config, status, details, _ = request.getfixturevalue("fedavg_run")
    else:
        config = run_config(tmp_path, strategy, 3, strategy=strategy)
        status, details = run_to_end(plain, config)
    assert status == "finished:completed", details
    folder = run_folder(config)
    assert {"config.json", "metrics.jsonl", "summary.json", "model.pt"} <= {path.name for path in folder.iterdir()}
    metrics = rows(folder)
    rounds = list(range(config.num_server_rounds + 1))  # FedAvg 1, SCAFFOLD 2
    assert [row["round"] for row in metrics] == rounds
    assert all(row["clients-trained"] == 3 and row["clients-evaluated"] == 3 for row in metrics[1:])
    assert set(metrics[-1]["local-accuracy-per-client"]) == {"0", "1", "2"}  # each node its own partition
    assert report_outcome(config, status, details) == 0
    assert f"results in {folder}" in capsys.readouterr().out
    board = EventAccumulator(str(folder))  # deployed, the ServerApp tracks to TensorBoard as it does in simulation
    board.Reload()
    assert [event.step for event in board.Scalars("accuracy")] == rounds
    # the ServerApp runs from an installed FAB, outside this checkout, and still names its commit
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["git-commit"] == checkout_commit(PROJECT_ROOT) != "unknown"


@pytest.mark.slow
@pytest.mark.long
def test_the_superlink_killed_mid_run_is_reported_and_the_printed_command_resumes_the_run_exactly(
    plain, home, tmp_path, capsys, fresh_temp
):
    """SCAFFOLD, 2 rounds: the SuperLink of a second deployment is killed after round 1's checkpoint; the run
    is given up at once, with the command that resumes it, which then runs on a third deployment with new
    SuperNode processes (c_i restored from their disk) and ends where the uninterrupted run ends, its logs beside
    the second deployment's in the run folder and nothing left in the temporary folder."""
    settings = {"strategy": "scaffold", "num-server-rounds": 2}
    straight = run_config(tmp_path, "straight", 3, **settings)
    assert run_to_end(plain, straight)[0] == "finished:completed"
    config = run_config(tmp_path, "killed-link", 3, **settings)
    folder = tmp_path / "killed-link"
    with deployment(loopback_topology(3, tmp_path / "work"), tmp_path / "work", folder / "logs") as running:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(running.run, config)
            wait_until(
                lambda: future.done() or (folder / CHECKPOINT).exists(),
                RUN_TIMEOUT_S,
                "round 1's checkpoint",
                interval_s=0.25,
            )
            assert not future.done(), future.result()
            running.services["superlink"].process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            status, reason = future.result(timeout=RUN_TIMEOUT_S)
            given_up_after = time.monotonic() - killed
    assert status == "aborted" and given_up_after < 10.0, (status, given_up_after)
    assert f"superlink exited with signal SIGKILL; its log: {folder / 'logs' / 'superlink.log'}" in (
        capsys.readouterr().err
    )
    command = reason.split("continue the run with:\n  ")[1]
    assert command == resume_command(config, 3, tls=False)
    assert deploy.main(shlex.split(command)[1:]) == 0
    assert f"logs in {folder / 'logs-2'}" in capsys.readouterr().out
    assert (folder / "logs" / "superlink.log").exists() and (folder / "logs-2" / "superlink.log").exists()
    assert list(fresh_temp.iterdir()) == []
    assert [r["round"] for r in rows(folder)] == [0, 1, 2]
    assert without_clock(rows(folder)) == without_clock(rows(tmp_path / "straight"))
    model, expected = torch.load(folder / "model.pt"), torch.load(tmp_path / "straight" / "model.pt")
    assert all(torch.equal(model[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_run_finishes_with_the_defaults_when_a_supernode_is_killed_in_round_two(plain, request, tmp_path, capsys):
    """SIGKILL to one flower-supernode, as a crash, with every default (min-available-nodes = all 3 nodes): the
    watch reports it within 10 s and stops its executor; the SuperLink notices the missing heartbeats (within
    20 s: the nodes beat at Flower's shortest interval, :func:`heartbeats`; about a minute at Flower's default) and
    answers the dead node's messages with errors; round 2 goes on with the two others and round 3 samples only the
    nodes online. The shared deployment's last test: it loses a node."""
    config = run_config(tmp_path, "killed", 3, **{"num-server-rounds": 3})
    assert config.min_available_nodes == 3
    folder = tmp_path / "killed"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(plain.run, config)
        wait_until(lambda: future.done() or len(rows(folder)) >= 2, RUN_TIMEOUT_S, "round 1's metrics", interval_s=0.25)
        assert not future.done(), future.result()
        plain.services["supernode-2"].process.send_signal(signal.SIGKILL)
        wait_until(
            lambda: "superexec-clientapp-2" in plain.exited, 10.0, "the watch to see supernode-2 exit", interval_s=0.1
        )
        request.getfixturevalue("flower_executor_run")  # starts beside the SuperLink's wait for the heartbeats
        status, details = future.result(timeout=RUN_TIMEOUT_S)
    assert status == "finished:completed", details
    err = capsys.readouterr().err
    assert f"supernode-2 exited with signal SIGKILL; its log: {plain.log_file('supernode-2')}" in err
    metrics = rows(folder)
    assert [row["round"] for row in metrics] == [0, 1, 2, 3]
    assert metrics[1]["clients-trained"] == 3 and metrics[1]["clients-evaluated"] == 3
    assert metrics[2]["clients-trained"] == 2
    # the dead node, if still sampled, is counted once and named by its partition
    assert metrics[2]["clients-sampled"] == 2 + metrics[2]["clients-dropped"] <= 3
    assert set(metrics[2]["clients-dropped-reasons"]) <= {"2"}
    assert metrics[3]["clients-sampled"] == metrics[3]["clients-trained"] == metrics[3]["clients-evaluated"] == 2
    assert (folder / "summary.json").exists()


@pytest.mark.slow
def test_warm_clientapp_processes_give_the_results_of_flowers_own_bit_for_bit(plain, fedavg_run, flower_executor_run):
    """The same seeded run on the shared deployment (the warm executor, the default: :func:`fedavg_run`) and on
    one whose SuperNodes start a fresh flwr-clientapp per message (Flower's executor: :func:`flower_executor_run`):
    every metric and the final model are equal."""
    assert plain.topology.executor == "warm"
    config, status, _, executor_log = fedavg_run
    assert status == "finished:completed"
    assert "ClientApp process pid" in executor_log  # forked by the warm parent
    executor, own_status, own_folder = flower_executor_run.result(timeout=RUN_TIMEOUT_S)
    assert executor == "flower-superexec" and own_status == "finished:completed"
    warm_folder = run_folder(config)
    warm, own = rows(warm_folder), rows(own_folder)
    assert [row["round"] for row in warm] == [0, 1] and warm[-1]["clients-trained"] == 3
    assert without_clock(warm) == without_clock(own)
    model, expected = torch.load(warm_folder / "model.pt"), torch.load(own_folder / "model.pt")
    assert model.keys() == expected.keys() and all(torch.equal(model[k], expected[k]) for k in expected)
