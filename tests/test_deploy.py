"""The deployment: docker-compose.yml and compose.tls.yml against fl_app/runtime/topology.py's commands, early refusals
and the service watch (fast), and the same topology as real processes on loopback (slow: FedAvg and SCAFFOLD
across 3 SuperNodes, a SuperNode killed mid-run with every default, the SuperLink killed mid-run and the run
resumed with the printed command, TLS with SuperNode authentication)."""

import json
import os
import re
import shlex
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import flwr
import httpx
import pytest
import torch
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fl_app.checkpoint import CHECKPOINT, config_differences
from fl_app.config import parse_run_config
from fl_app.provenance import checkout_commit
from fl_app.runtime import deploy
from fl_app.runtime import deployment as deployment_module
from fl_app.runtime.common import PROJECT_ROOT, free_port
from fl_app.runtime.deployment import Deployment, deployment, partner_of, resume_command
from fl_app.runtime.flwr_cli import online_supernodes, parse_overrides
from fl_app.runtime.launch import prepare_config, report_outcome
from fl_app.runtime.superlink import trust, wait_until
from fl_app.runtime.topology import (
    Topology,
    clientapp_executor_command,
    compose_topology,
    loopback_topology,
    make_certificates,
    register_command,
    serverapp_executor_command,
    superlink_command,
    supernode_command,
    supernode_entry_point,
)

COMPOSE = PROJECT_ROOT / "docker-compose.yml"
COMPOSE_TLS = PROJECT_ROOT / "compose.tls.yml"
RUN_TIMEOUT_S = 900
TINY = {"dataset": "digits", "model": "small-mlp", "num-server-rounds": 2}


# --- the compose files and the loopback script agree (no Docker needed) ---


def compose_services(tls: bool) -> dict[str, dict]:
    """docker-compose.yml's services, with compose.tls.yml over them as ``docker compose -f … -f …`` merges
    them: an override's command replaces the base's, volumes and dependencies are added."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    if tls:
        for name, override in yaml.safe_load(COMPOSE_TLS.read_text())["services"].items():
            merged = {**services.get(name, {}), **override}
            merged["volumes"] = [*services.get(name, {}).get("volumes", []), *override.get("volumes", [])]
            merged["depends_on"] = {**services.get(name, {}).get("depends_on", {}), **override.get("depends_on", {})}
            services[name] = merged
    return services


def expected_commands(topology: Topology) -> dict[str, list[str]]:
    """Every service's argv as fl_app/runtime/topology.py builds it, by compose service name."""
    commands = {"superlink": superlink_command(topology), "superexec-serverapp": serverapp_executor_command(topology)}
    for node in range(topology.num_supernodes):
        commands[f"supernode-{node}"] = supernode_command(topology, node)
        commands[f"superexec-clientapp-{node}"] = clientapp_executor_command(topology, node)
    if topology.certificates is not None:
        commands["supernode-register"] = register_command(topology)
    return commands


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_services_run_the_commands_of_the_loopback_script(tls):
    services = compose_services(tls)
    num_supernodes = sum(bool(re.fullmatch(r"supernode-\d+", name)) for name in services)
    assert num_supernodes == 3
    expected = expected_commands(compose_topology(tls, num_supernodes))
    # entry point + command, flags, node configs, addresses and paths, and no service more or less
    assert {name: [*service["entrypoint"], *service["command"]] for name, service in services.items()} == expected
    # the compose check runs an extra SuperNode as `compose run supernode-0 <command without the entry point>`
    assert services["supernode-0"]["entrypoint"] == supernode_entry_point(compose_topology(tls, num_supernodes))


def mount_target(volume: str) -> str:
    """The container path of a short-syntax volume ``SOURCE:TARGET[:MODE]`` (SOURCE may hold ``${VAR:-x}``)."""
    return re.sub(r"\$\{[^}]*\}", "SOURCE", volume).split(":")[1]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_wiring_images_networks_and_mounts(tls):
    services = compose_services(tls)
    assert {service["image"] for service in services.values()} == {"alignfl:flwr-1.42.0"}
    assert {service["build"] for service in services.values()} == {"."}
    for name, service in services.items():
        if name.startswith("superexec-clientapp-"):  # reaches its SuperNode's Runtime API on 127.0.0.1
            assert service["network_mode"] == f"service:supernode-{name.rsplit('-', 1)[1]}"
        mounted = [mount_target(volume) for volume in service.get("volumes", [])]
        for path in (arg for arg in service["command"] if arg.startswith("/app/certs/")):
            assert any(path == target or path.startswith(target + "/") for target in mounted), (name, path)
        if tls and re.fullmatch(r"supernode-\d+", name):  # keys are registered before any SuperNode starts
            assert service["depends_on"]["supernode-register"] == {"condition": "service_completed_successfully"}
    results = services["superexec-serverapp"]["volumes"][0]
    assert results.endswith(":/app/alignfl-results")  # results-dir's default (~/alignfl-results) in the image


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_publishes_on_this_host_only_unless_told_and_reads_keys_from_a_folder_named_outside(tls):
    services = compose_services(tls)
    published = [(name, port) for name, service in services.items() for port in service.get("ports", [])]
    assert [name for name, _ in published] == ["superlink"]
    for name, port in published:  # short syntax HOST_IP:HOST_PORT:CONTAINER_PORT, each ${VAR:-x} at its default
        at_default = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", port)
        assert at_default.startswith("127.0.0.1:") and at_default.count(":") == 2, (name, port)
    keys = [volume for service in services.values() for volume in service.get("volumes", [])]
    keys = [volume for volume in keys if mount_target(volume).startswith("/app/certs")]
    assert bool(keys) == tls
    assert all(volume.startswith("${ALIGNFL_CERTS:?") for volume in keys)  # no default: it would be in the checkout


def test_image_pins_the_projects_flower():
    pinned = next(
        dep
        for dep in tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if dep.startswith("flwr[")
    )
    version = pinned.split("==")[1]
    assert version == flwr.__version__
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert f"ARG FLWR_IMAGE=flwr/superexec:{version}-py3.11-" in dockerfile
    assert f"flwr.__version__ == '{version}'" in dockerfile


def test_make_certs_signs_the_superlink_for_its_names_and_makes_flower_readable_keys(tmp_path):
    certs = make_certificates(tmp_path / "certs", 2)
    server = x509.load_pem_x509_certificate((certs / "superlink.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"superlink", "localhost"}
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    verified = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            certs / "ca.crt",
            certs / "superlink.crt",
            certs / "supernode-1" / "runtime.crt",
        ],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    private = load_ssh_private_key((certs / "supernode-0" / "auth").read_bytes(), None)  # what flower-supernode reads
    public = load_ssh_public_key(
        (certs / "supernode-0" / "auth.pub").read_bytes()
    )  # what flwr supernode register reads
    assert private.public_key() == public and public.curve.name == "secp384r1"
    first_key = (certs / "supernode-0" / "auth").read_bytes()
    make_certificates(certs, 3)  # a larger count adds a node and keeps the others' keys
    assert (certs / "supernode-0" / "auth").read_bytes() == first_key and (certs / "supernode-2" / "auth.pub").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-supernodes", "0"], "--num-supernodes must be at least 1, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--certs", "/tmp"], "--certs is only used with --tls"),
        (["--run-config", 'dataset="digits" lr=-1'], "lr"),
        (["--num-supernodes", "2", "--run-config", 'dataset="digits" min-available-nodes=3'], "min-available-nodes"),
    ],
)
def test_deploy_refuses_bad_input_before_starting_anything(argv, message, capsys, tmp_path):
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "work")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--work-dir", "/proc/alignfl"], "--work-dir '/proc/alignfl' is not allowed"),
        (["--tls", "--certs", "/proc/alignfl-certs"], "--certs '/proc/alignfl-certs' is not allowed"),
        (["--run-config", 'dataset="digits" results-dir="/proc/alignfl"'], "'results-dir' = '/proc/alignfl'"),
        (["--run-config", 'dataset="digits" data-root="/proc/alignfl"'], "'data-root' = '/proc/alignfl'"),
    ],
)
def test_deploy_refuses_unwritable_folders_naming_them(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(deploy, "deployment", None)  # starting one would fail loudly
    assert deploy.main(["--num-supernodes", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_resume_command_continues_the_same_run(tmp_path):
    config = prepare_config(
        {
            "dataset": "digits",
            "strategy": "scaffold",
            "lr": 0.1,
            "run-name": "r",
            "results-dir": str(tmp_path),
            "num-server-rounds": 6,
        },
        3,
    )
    command = shlex.split(resume_command(config, 3, tls=True))
    assert command[:5] == [
        str(PROJECT_ROOT / "scripts" / "deploy.sh"),
        "--num-supernodes",
        "3",
        "--tls",
        "--run-config",
    ]
    overrides = parse_overrides(command[5])
    assert overrides["resume-from"] == str(tmp_path / "r") and "run-name" not in overrides
    resumed = parse_run_config(overrides)  # prepare_config would also want the checkpoint
    assert config_differences(config.to_run_config(), resumed) == {}
    assert resumed.num_server_rounds == 6 and resumed.resume_from == str(tmp_path / "r")


def test_the_executor_is_warm_unless_flowers_own_is_asked_for_and_a_resumed_run_keeps_it(tmp_path, capsys):
    topology = loopback_topology(2, tmp_path)
    assert clientapp_executor_command(topology, 1)[:4] == [
        "python",
        "-m",
        "fl_app.patches.warm_superexec",
        "--runtime-api-address",
    ]
    own = replace(topology, executor="flower")
    assert clientapp_executor_command(own, 1)[:2] == ["flower-superexec", "--runtime-api-address"]
    assert clientapp_executor_command(own, 1)[1:] == clientapp_executor_command(topology, 1)[3:]
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"}, 2)
    assert "--executor" not in resume_command(config, 2, tls=False)
    assert shlex.split(resume_command(config, 2, tls=False, executor="flower"))[3:5] == ["--executor", "flower"]
    with pytest.raises(SystemExit) as refused:
        deploy.main(["--executor", "fast", "--work-dir", str(tmp_path / "work")])
    assert refused.value.code == 2 and "--executor: invalid choice: 'fast'" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_supernodes_poll_every_half_second_unless_flowers_own_is_asked_for_and_a_resumed_run_keeps_it(tmp_path, capsys):
    topology = loopback_topology(2, tmp_path)
    assert supernode_command(topology, 1)[:5] == [
        "python",
        "-m",
        "fl_app.patches.polling_supernode",
        "--poll-interval",
        "0.5",
    ]
    own = replace(topology, node_poll_s=None)
    assert supernode_command(own, 1)[0] == "flower-supernode"
    assert supernode_command(own, 1)[1:] == supernode_command(topology, 1)[5:]
    assert supernode_command(replace(topology, node_poll_s=0.25), 1)[3:5] == ["--poll-interval", "0.25"]
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"}, 2)
    assert "--node-poll" not in resume_command(config, 2, tls=False)
    assert shlex.split(resume_command(config, 2, tls=False, node_poll_s=None))[3:5] == ["--node-poll", "flower"]
    assert shlex.split(resume_command(config, 2, tls=False, node_poll_s=1.0))[3:5] == ["--node-poll", "1"]
    with pytest.raises(SystemExit) as refused:
        deploy.main(["--node-poll", "5", "--work-dir", str(tmp_path / "work")])
    assert refused.value.code == 2 and "--node-poll: '5' is not allowed: seconds in (0, 3]" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_the_superlink_keeps_its_state_in_memory_unless_a_file_is_asked_for(tmp_path, capsys):
    assert "--database" not in superlink_command(loopback_topology(2, tmp_path))
    command = superlink_command(loopback_topology(2, tmp_path, superlink_db=tmp_path / "state.db"))
    assert command[command.index("--database") + 1] == str(tmp_path / "state.db")
    assert superlink_command(compose_topology())[-3:-1] == ["--database", "/app/state/superlink.db"]  # a volume
    (tmp_path / "file").write_text("not a folder")
    assert (
        deploy.main(["--superlink-db", str(tmp_path / "file" / "state.db"), "--work-dir", str(tmp_path / "work")]) == 2
    )
    assert "--superlink-db" in capsys.readouterr().err and not (tmp_path / "work").exists()


def test_a_node_goes_down_whole(tmp_path):
    assert partner_of("supernode-2") == "superexec-clientapp-2"
    assert partner_of("superexec-clientapp-10") == "supernode-10"
    assert partner_of("superlink") is None and partner_of("superexec-serverapp") is None


def test_the_watch_reports_exits_stops_a_nodes_other_half_and_gives_up_without_the_superlink(
    tmp_path, capsys, monkeypatch
):
    """Stand-in services (sleep): the watch names the service, its exit and its log at its next call."""
    running = Deployment(loopback_topology(2, tmp_path), tmp_path)
    names = [
        "superlink",
        "superexec-serverapp",
        "supernode-0",
        "superexec-clientapp-0",
        "supernode-1",
        "superexec-clientapp-1",
    ]
    for name in names:
        running.start_service(name, ["sleep", "300"])
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"}, 2)
    monkeypatch.setattr(deployment_module, "checkpointed_round", lambda _: 1)
    try:
        assert running.watch(config) is None and running.exited == {}
        running.services["supernode-1"].process.send_signal(signal.SIGKILL)
        running.services["supernode-1"].process.wait()
        assert running.watch(config) is None
        err = capsys.readouterr().err
        assert f"supernode-1 exited with signal SIGKILL; its log: {tmp_path / 'logs' / 'supernode-1.log'}" in err
        assert "stopping superexec-clientapp-1 too" in err
        assert set(running.exited) == {"supernode-1", "superexec-clientapp-1"}
        assert running.services["superexec-clientapp-1"].process.poll() is not None
        running.services["superlink"].process.terminate()
        running.services["superlink"].process.wait()
        reason = running.watch(config)
        assert reason is not None and "the SuperLink exited with signal SIGTERM" in reason
        assert resume_command(config, 2, tls=False) in reason and "rounds up to 1 are checkpointed" in reason
        assert f"superlink exited with signal SIGTERM; its log: {tmp_path / 'logs' / 'superlink.log'}" in (
            capsys.readouterr().err
        )
    finally:
        running.stop()
    assert all(tree.process.poll() is not None for tree in running.services.values())


def test_register_refuses_missing_key_files(tmp_path, capsys):
    assert (
        deploy.main(
            [
                "register",
                "--superlink",
                "127.0.0.1:1",
                "--root-certificates",
                str(tmp_path / "ca.crt"),
                str(tmp_path / "auth.pub"),
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err


def test_failed_run_exits_non_zero(tmp_path):
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"}, 2)
    assert report_outcome(config, "finished:failed", "ServerApp raised") == 1
    assert report_outcome(config, "finished:completed", "") == 1  # completed but no summary written


# --- loopback deployments (slow) ---


def rows(folder: Path) -> list[dict]:
    """metrics.jsonl's complete lines (a line being written is left out)."""
    path = folder / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def run_config(results: Path, name: str, num_supernodes: int, **overrides):
    return prepare_config({**TINY, "results-dir": str(results), "run-name": name, **overrides}, num_supernodes)


def run_to_end(running: Deployment, config) -> tuple[str, str]:
    """The run's final status; a hung run fails the test (stopping the deployment then ends the log stream)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(running.run, config).result(timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Iterator[Path]:
    """A home folder of their own for the services: their clients keep state under ~/.cache/alignfl."""
    folder = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(folder))
        yield folder


@pytest.fixture(scope="module")
def plain(tmp_path_factory, home) -> Iterator[Deployment]:
    """One plaintext deployment of 3 SuperNodes shared by the tests below; the node-killing test goes last."""
    work = tmp_path_factory.mktemp("deploy")
    with deployment(loopback_topology(3, work), work) as running:
        yield running


@pytest.mark.slow
def test_loopback_runs_exactly_the_compose_services(plain):
    assert {name: tree.process.args for name, tree in plain.services.items()} == expected_commands(plain.topology)
    assert list(plain.services)[:2] == ["superlink", "superexec-serverapp"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedavg", pytest.param("scaffold", marks=pytest.mark.long)])
def test_strategy_completes_two_rounds_on_three_supernodes(plain, strategy, tmp_path, capsys):
    config = run_config(tmp_path, strategy, 3, strategy=strategy)
    status, details = run_to_end(plain, config)
    assert status == "finished:completed", details
    folder = tmp_path / strategy
    assert {"config.json", "metrics.jsonl", "summary.json", "model.pt"} <= {path.name for path in folder.iterdir()}
    metrics = rows(folder)
    assert [row["round"] for row in metrics] == [0, 1, 2]
    assert all(row["clients-trained"] == 3 and row["clients-evaluated"] == 3 for row in metrics[1:])
    assert set(metrics[-1]["local-accuracy-per-client"]) == {"0", "1", "2"}  # each node its own partition
    assert report_outcome(config, status, details) == 0
    assert f"results in {folder}" in capsys.readouterr().out
    board = EventAccumulator(str(folder))  # deployed, the ServerApp tracks to TensorBoard as it does in simulation
    board.Reload()
    assert [event.step for event in board.Scalars("accuracy")] == [0, 1, 2]
    # the ServerApp runs from an installed FAB, outside this checkout, and still names its commit
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["git-commit"] == checkout_commit(PROJECT_ROOT) != "unknown"


def without_clock(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed-s"} for r in records]


@pytest.mark.slow
@pytest.mark.long
def test_the_superlink_killed_mid_run_is_reported_and_the_printed_command_resumes_the_run_exactly(
    plain, home, tmp_path, capsys
):
    """SCAFFOLD, 2 rounds: the SuperLink of a second deployment is killed after round 1's checkpoint; the run
    is given up at once, with the command that resumes it, which then runs on a third deployment with new
    SuperNode processes (c_i restored from their disk) and ends where the uninterrupted run ends."""
    settings = {"strategy": "scaffold", "num-server-rounds": 2}
    straight = run_config(tmp_path, "straight", 3, **settings)
    assert run_to_end(plain, straight)[0] == "finished:completed"
    config = run_config(tmp_path, "killed-link", 3, **settings)
    folder = tmp_path / "killed-link"
    with deployment(loopback_topology(3, tmp_path / "work"), tmp_path / "work") as running:
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
    assert f"superlink exited with signal SIGKILL; its log: {tmp_path / 'work' / 'logs' / 'superlink.log'}" in (
        capsys.readouterr().err
    )
    command = reason.split("continue the run with:\n  ")[1]
    assert command == resume_command(config, 3, tls=False)
    assert deploy.main([*shlex.split(command)[1:], "--work-dir", str(tmp_path / "again")]) == 0
    assert [r["round"] for r in rows(folder)] == [0, 1, 2]
    assert without_clock(rows(folder)) == without_clock(rows(tmp_path / "straight"))
    model, expected = torch.load(folder / "model.pt"), torch.load(tmp_path / "straight" / "model.pt")
    assert all(torch.equal(model[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_warm_clientapp_processes_give_the_results_of_flowers_own_bit_for_bit(plain, tmp_path):
    """The same seeded run on the shared deployment (the warm executor, the default) and on one whose SuperNodes
    start a fresh flwr-clientapp per message (Flower's executor): every metric and the final model are equal."""
    assert plain.topology.executor == "warm"
    assert run_to_end(plain, run_config(tmp_path, "warm", 3))[0] == "finished:completed"
    assert "ClientApp process pid" in plain.log_tail("superexec-clientapp-0", 200)  # forked by the warm parent
    work = tmp_path / "flower"
    with deployment(loopback_topology(3, work, executor="flower"), work) as running:
        assert running.services["superexec-clientapp-0"].process.args[0] == "flower-superexec"
        assert run_to_end(running, run_config(tmp_path, "own", 3))[0] == "finished:completed"
    warm, own = rows(tmp_path / "warm"), rows(tmp_path / "own")
    assert [row["round"] for row in warm] == [0, 1, 2] and warm[-1]["clients-trained"] == 3
    assert without_clock(warm) == without_clock(own)
    model, expected = torch.load(tmp_path / "warm" / "model.pt"), torch.load(tmp_path / "own" / "model.pt")
    assert model.keys() == expected.keys() and all(torch.equal(model[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_run_finishes_with_the_defaults_when_a_supernode_is_killed_in_round_two(plain, tmp_path, capsys):
    """SIGKILL to one flower-supernode, as a crash, with every default (min-available-nodes = all 3 nodes): the
    watch reports it within 10 s and stops its executor; the SuperLink notices the missing heartbeats (within
    about a minute) and answers the dead node's messages with errors; round 2 goes on with the two others and
    round 3 samples only the nodes online."""
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


def listening_ports(pids: set[int]) -> set[int]:
    """The TCP ports these processes listen on (from /proc: socket inodes of their descriptors)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
def test_tls_with_supernode_authentication(tmp_path):
    """Two authorised SuperNodes train; a third with a key that was never registered is refused; every
    port the deployment listens on speaks TLS only."""
    certs = make_certificates(tmp_path / "certs", 3)  # node 2's key exists but is not registered
    topology = loopback_topology(2, tmp_path / "work", certs)
    with deployment(topology, tmp_path / "work") as running:
        ports = listening_ports({pid for tree in running.services.values() for pid in tree.refresh()})
        assert ports == {topology.superlink_port, *topology.runtime_ports}
        for port in ports:
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert httpx.get(f"https://127.0.0.1:{port}/health", verify=trust(running.ca), timeout=10).is_success

        stranger = replace(topology, num_supernodes=3, runtime_ports=(*topology.runtime_ports, free_port()))
        refused = running.start_service("supernode-2-unregistered", supernode_command(stranger, 2))
        config = run_config(tmp_path / "results", "tls", 2, **{"num-server-rounds": 1})
        status, details = run_to_end(running, config)
        assert refused.process.wait(timeout=RUN_TIMEOUT_S) != 0
        assert "Failed to activate SuperNode" in running.log_tail("supernode-2-unregistered", 40)
        assert online_supernodes(running.cli_environment) == 2
    assert status == "finished:completed", details
    metrics = rows(tmp_path / "results" / "tls")
    assert metrics[-1]["round"] == 1 and metrics[-1]["clients-trained"] == 2
