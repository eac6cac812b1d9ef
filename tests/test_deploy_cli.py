"""deploy before anything starts and around a run, without Flower's processes: early refusals, the SuperLink's state
file, the executor and poll options a resumed run keeps, the resume command, the service watch on stand-in
processes, and where a run's logs go and what of its folders is left however it ends."""

import json
import os
import shlex
import signal
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from alignfl.fl_app.checkpoint import config_differences
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.runtime import deploy
from alignfl.fl_app.runtime import deployment as deployment_module
from alignfl.fl_app.runtime import topology as topology_module
from alignfl.fl_app.runtime.deployment import Deployment, partner_of, resume_command, run_logs
from alignfl.fl_app.runtime.flwr_cli import parse_overrides
from alignfl.fl_app.runtime.launch import prepare_config, report_outcome
from alignfl.fl_app.runtime.topology import (
    clientapp_executor_command,
    compose_topology,
    loopback_topology,
    superlink_command,
    supernode_command,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-supernodes", "0"], "--num-supernodes must be at least 1, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--certs", "/tmp"], "--certs is only used with --tls"),
        (["--run-config", 'dataset="digits" lr=-1'], "lr"),
        (["--num-supernodes", "2", "--run-config", 'dataset="digits" min-available-nodes=3'], "min-available-nodes"),
        (["--superlink-db", "/tmp"], "--superlink-db '/tmp' is not allowed: it is a folder"),
        (["--superlink-db", __file__], "it is not an SQLite database"),
        (["--superlink-db", "/proc/alignfl/state.db"], "its folder cannot hold a new file"),
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


def test_deploy_takes_a_new_path_or_an_sqlite_file_for_the_superlinks_state(tmp_path):
    assert topology_module.superlink_db_problem(tmp_path / "new.db") is None
    (tmp_path / "empty.db").touch()  # SQLite makes a database in an empty file
    assert topology_module.superlink_db_problem(tmp_path / "empty.db") is None
    sqlite3.connect(tmp_path / "kept.db").execute("create table t (x)").connection.commit()
    assert topology_module.superlink_db_problem(tmp_path / "kept.db") is None


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
        "alignfl.fl_app.patches.warm_superexec",
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
        "alignfl.fl_app.patches.polling_supernode",
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


def stand_in_deployment(how: str):
    """``deployment`` for a run that ends as ``how`` says, started nothing but writing what the real one writes: a
    Flower home under its work folder and a log in its log folder."""

    @contextmanager
    def started(topology, work, logs):
        (work / "homes" / "superlink").mkdir(parents=True)
        (work / "homes" / "superlink" / "state.db").write_bytes(b"")
        (logs / "superlink.log").write_text("started\n")
        if how == "failed":
            raise RuntimeError("the SuperLink exited with code 1")
        yield SimpleNamespace(run=lambda config: run(config), exited={})

    def run(config):
        if how == "completed":
            (run_logs(config).parent / "summary.json").write_text(json.dumps({"final-accuracy": 1, "best-accuracy": 1}))
            return "finished:completed", ""
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)
        raise AssertionError("the stop signal did not stop the deployment")

    return started


@pytest.mark.parametrize(
    "how, code", [("completed", 0), ("failed", 1), ("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", 128 + signal.SIGINT)]
)
def test_a_deployment_keeps_its_logs_in_the_run_folder_and_nothing_in_the_temporary_folder(
    how, code, fresh_temp, tmp_path, monkeypatch, capsys
):
    """Without --work-dir the services' logs go to the run folder's logs/ (printed at the start) and their Flower
    homes go with their temporary folder, on success, failure, SIGTERM and Ctrl-C; with it, both stay there."""
    monkeypatch.setattr(deploy, "deployment", stand_in_deployment(how))
    argv = ["--num-supernodes", "2", "--run-config", f'dataset="digits" results-dir="{tmp_path}" run-name="r"']
    assert deploy.main(argv) == code
    assert list(fresh_temp.iterdir()) == []
    assert (tmp_path / "r" / "logs" / "superlink.log").read_text() == "started\n"
    assert f"logs in {tmp_path / 'r' / 'logs'}" in capsys.readouterr().out
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "work")]) == code
    assert (tmp_path / "work" / "logs" / "superlink.log").exists()
    assert (tmp_path / "work" / "homes" / "superlink" / "state.db").exists()
    assert list(fresh_temp.iterdir()) == []


def test_a_later_deployment_of_the_same_run_folder_keeps_the_earlier_ones_logs(tmp_path):
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path), "run-name": "r"}, 2)
    assert run_logs(config) == tmp_path / "r" / "logs"
    (tmp_path / "r" / "logs").mkdir(parents=True)
    assert run_logs(config) == tmp_path / "r" / "logs"  # empty: nothing to keep
    (tmp_path / "r" / "logs" / "superlink.log").write_text("the first deployment\n")
    assert run_logs(config) == tmp_path / "r" / "logs-2"
    (tmp_path / "r" / "logs-2").mkdir()
    (tmp_path / "r" / "logs-2" / "superlink.log").write_text("the second deployment\n")
    assert run_logs(config) == tmp_path / "r" / "logs-3"
