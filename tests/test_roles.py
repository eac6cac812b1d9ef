"""The deployment's roles for real machines (fast parts): the SuperLink's certificate for the names nodes dial,
a node's check of the SuperLink before it starts, and options refused before anything starts. The roles run
across three network namespaces in scripts/hosts_check.sh."""

import json
import os
import shutil
import signal
import socket
import ssl
import tempfile
import threading
import time

import pytest

from alignfl.fl_app.checkpoint import run_folder
from alignfl.fl_app.runtime import deploy, roles
from alignfl.fl_app.runtime.common import free_port
from alignfl.fl_app.runtime.reach import Unreachable, listen_host, tls_problem, wait_for_superlink
from alignfl.fl_app.runtime.roles import (
    RefusedKeys,
    certificate_names,
    parser_for,
    subject_names,
    superlink_certificates,
    supernodes_topology,
)
from alignfl.fl_app.runtime.topology import make_certificates


def test_the_superlink_certificate_names_every_address_the_nodes_dial(tmp_path):
    assert subject_names(["10.0.0.1", "fl.example.org", "::1"]) == "IP:10.0.0.1,DNS:fl.example.org,IP:::1"
    certs = superlink_certificates(tmp_path / "certs", 2, ["10.0.0.1", "fl.example.org"])
    assert certificate_names(certs / "superlink.crt") == {
        "superlink",
        "localhost",
        "127.0.0.1",
        "10.0.0.1",
        "fl.example.org",
    }
    with pytest.raises(ValueError, match=r"does not name 10.0.0.2 .* remove superlink.crt and superlink.key"):
        superlink_certificates(certs, 2, ["10.0.0.1", "10.0.0.2"])  # make_certs.sh keeps the old certificate


def serve_tls(certs, port: int) -> threading.Thread:
    """One TLS handshake on 127.0.0.1:port with the SuperLink's certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs / "superlink.crt", certs / "superlink.key")
    listener = socket.create_server(("127.0.0.1", port))

    def accept() -> None:
        with listener:
            connection, _ = listener.accept()
            try:
                with context.wrap_socket(connection, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                connection.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return thread


def test_a_node_checks_the_superlinks_certificate_and_reach_before_starting(tmp_path):
    certs = make_certificates(tmp_path / "certs", 1)
    other = make_certificates(tmp_path / "other", 1)  # another deployment's CA
    port = free_port()
    serve_tls(certs, port)
    assert tls_problem(f"127.0.0.1:{port}", str(certs / "ca.crt")) is None
    port = free_port()
    serve_tls(certs, port)
    problem = tls_problem(f"127.0.0.1:{port}", str(other / "ca.crt"))
    assert problem is not None and "presents a certificate this node does not accept" in problem
    closed = free_port()
    with pytest.raises(Unreachable, match="cannot be reached"):
        tls_problem(f"127.0.0.1:{closed}", str(certs / "ca.crt"), timeout_s=2.0)
    assert "cannot be reached" in wait_for_superlink(f"127.0.0.1:{closed}", str(certs / "ca.crt"), timeout_s=1.0)


def test_a_plaintext_node_machine_says_on_the_console_while_its_superlink_does_not_answer(tmp_path, capsys):
    closed = free_port()
    argv = ["supernodes", "--superlink", f"127.0.0.1:{closed}", "--nodes", "0", "--num-supernodes", "1"]
    assert deploy.main([*argv, "--superlink-wait", "2", "--work-dir", str(tmp_path / "work")]) == 1
    err = capsys.readouterr().err
    assert f"the SuperLink at 127.0.0.1:{closed} cannot be reached" in err
    assert "trying again every 1 s for up to 2 s (--superlink-wait)" in err
    assert "SuperNodes not started" in err and "(tried for 2 s)" in err
    assert not (tmp_path / "work").exists()  # made for the nodes that never started, and removed again
    port = free_port()
    late: list[socket.socket] = []  # a SuperLink that starts later, kept open until the end of the test
    threading.Timer(1.5, lambda: late.append(socket.create_server(("127.0.0.1", port)))).start()
    assert wait_for_superlink(f"127.0.0.1:{port}", None, timeout_s=30.0) is None
    captured = capsys.readouterr()
    assert "cannot be reached" in captured.err and f"the SuperLink at 127.0.0.1:{port} answers" in captured.out
    late[0].close()


def test_the_superlink_listens_where_it_is_told_never_everywhere_unless_asked_by_name():
    assert listen_host(None, []) == "127.0.0.1"  # no address the nodes dial: this machine only
    assert listen_host(None, ["127.0.0.1", "localhost"]) == "127.0.0.1"  # a name with A and AAAA: its IPv4
    assert listen_host("0.0.0.0", ["10.0.0.1"]) == "0.0.0.0"  # asked for by name
    assert listen_host("10.0.0.1", []) == "10.0.0.1"
    with pytest.raises(ValueError, match=r"none is an address of this machine.*give --host"):
        listen_host(None, ["192.0.2.1"])  # TEST-NET-1: no machine's own address
    parsed = parser_for("superlink").parse_args(["--num-supernodes", "1"])
    assert parsed.host is None


def test_a_plaintext_superlink_on_every_interface_is_warned_about(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(roles, "run_superlink_side", lambda args, config, work: 0)  # nothing starts
    base = ["superlink", "--num-supernodes", "1", "--serve", "--work-dir", str(tmp_path / "work")]
    assert deploy.main([*base, "--host", "0.0.0.0"]) == 0
    assert "warning: a plaintext SuperLink on every interface (0.0.0.0)" in capsys.readouterr().err
    assert deploy.main(base) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["supernodes", "--superlink", "10.0.0.1", "--nodes", "0", "--num-supernodes", "2"],
            "--superlink '10.0.0.1' is not allowed: give host:port",
        ),
        (
            ["supernodes", "--superlink", "10.0.0.1:9093", "--nodes", "2", "--num-supernodes", "2"],
            "--nodes [2] is not allowed",
        ),
        (
            ["supernodes", "--superlink", "10.0.0.1:9093", "--nodes", "0", "0", "--num-supernodes", "2"],
            "--nodes [0, 0] is not allowed",
        ),
        (
            ["supernodes", "--superlink", "10.0.0.1:9093", "--nodes", "0", "--num-supernodes", "2", "--tls"],
            "--tls on a node machine needs --certs",
        ),
        (["superlink", "--num-supernodes", "2", "--tls"], "--tls needs --address"),
        (["superlink", "--num-supernodes", "2", "--serve", "--rounds", "3"], "--serve runs no experiment"),
        (["superlink", "--num-supernodes", "0"], "--num-supernodes must be at least 1"),
        (["superlink", "--num-supernodes", "2", "--port", "70000"], "--port 70000 is not allowed"),
        (
            ["superlink", "--num-supernodes", "2", "--address", "192.0.2.1"],
            "none is an address of this machine",
        ),
        (
            ["superlink", "--num-supernodes", "2", "--superlink-db", "/tmp"],
            "--superlink-db '/tmp' is not allowed: it is a folder",
        ),
        (
            ["superlink", "--num-supernodes", "2", "--superlink-db", __file__],
            "it is not an SQLite database",
        ),
    ],
)
def test_roles_refuse_bad_options_before_starting_anything(argv, message, tmp_path, capsys):
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "work")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_node_machine_needs_its_own_key_files(tmp_path, capsys):
    certs = make_certificates(tmp_path / "certs", 2)
    shutil.rmtree(certs / "supernode-1")
    argv = [
        "supernodes",
        "--superlink",
        "10.0.0.1:9093",
        "--nodes",
        "0",
        "1",
        "--num-supernodes",
        "2",
        "--tls",
        "--certs",
        str(certs),
        "--work-dir",
        str(tmp_path / "work"),
    ]
    assert deploy.main(argv) == 2
    assert f"lacks {certs}/supernode-1/auth" in capsys.readouterr().err


class NodeMachine:
    """A stand-in for a node machine's Deployment: which services exited, their logs, and the nodes restarted."""

    def __init__(self, tmp_path, logs: dict[str, str]) -> None:
        args = parser_for("supernodes").parse_args(
            [
                "--superlink",
                "10.0.0.1:9093",
                "--nodes",
                "0",
                "1",
                "--num-supernodes",
                "2",
                "--tls",
                "--certs",
                str(tmp_path),
            ]
        )
        self.topology = supernodes_topology(args, tmp_path)
        self.exited = {name: "code 1" for name in logs}
        self.logs = logs
        self.restarted: list[int] = []

    def log_tail(self, name: str, lines: int = 15) -> str:
        return self.logs[name]

    def restart_node(self, node: int) -> None:
        self.restarted.append(node)
        self.exited.pop(f"supernode-{node}")


def test_a_node_whose_key_is_not_registered_yet_is_started_again_until_the_wait_runs_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(roles.time, "sleep", lambda seconds: None)
    refusal = (
        "ERROR : Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
        "[code: 2004] Failed to activate SuperNode.\n"
    )
    machine = NodeMachine(tmp_path, {"supernode-0": refusal, "supernode-1": "ValueError: another failure"})
    RefusedKeys(machine, [0, 1], deadline=roles.time.monotonic() + 60)()
    assert machine.restarted == [0]  # node 1 failed otherwise: reported, not restarted
    assert (
        "does not accept supernode-0's key (not registered yet?); starting it again in 5 s" in capsys.readouterr().err
    )
    machine.exited["supernode-0"] = "code 1"
    late = RefusedKeys(machine, [0, 1], deadline=roles.time.monotonic() - 1)
    late(), late()
    assert machine.restarted == [0]
    err = capsys.readouterr().err
    assert err.count("gave up (--superlink-wait)") == 1
    assert f"Register {tmp_path}/supernode-0/auth.pub on the SuperLink's machine" in err


def test_the_roles_refuse_private_keys_that_git_would_commit_naming_them(exposed_key_repo, tmp_path, capsys):
    keys = exposed_key_repo / "keys"
    for argv in (
        ["superlink", "--num-supernodes", "1", "--tls", "--address", "127.0.0.1", "--certs", str(keys)],
        ["supernodes", "--superlink", "127.0.0.1:9093", "--nodes", "0", "--num-supernodes", "1", "--tls"]
        + ["--certs", str(keys)],
    ):
        assert deploy.main([*argv, "--work-dir", str(tmp_path / "work")]) == 2
        assert f"private keys inside a git work tree that does not ignore them: {keys}/auth" in capsys.readouterr().err
        assert not (tmp_path / "work").exists()


class NodesStandIn:
    """A node machine's deployment that starts nothing but writes a log where the real one would."""

    def __init__(self, topology, work):
        self.work = work

    def start_supernodes(self, nodes):
        (self.work / "logs").mkdir()
        (self.work / "logs" / "supernode-0.log").write_text("started\n")

    def stop(self):
        pass


def ends(how: str):
    """``serve`` for one way a node machine's role ends."""

    def serve(running, after_exits=None):
        assert (running.work / "logs" / "supernode-0.log").exists()  # the folder was in use until now
        if how == "every service exited":
            return 1
        if how == "failure":
            raise RuntimeError("a node could not be started")
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)
        raise AssertionError("the stop signal did not stop the role")

    return serve


@pytest.mark.parametrize(
    "how, code",
    [
        ("unreachable", 1),
        ("every service exited", 1),
        ("failure", None),
        ("SIGTERM", 128 + signal.SIGTERM),
        ("SIGINT", 128 + signal.SIGINT),
    ],
)
def test_a_node_machine_leaves_no_temporary_folder_however_it_ends(how, code, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(roles, "Deployment", NodesStandIn)
    monkeypatch.setattr(roles, "serve", ends(how))
    if how == "unreachable":  # no node ever started
        monkeypatch.setattr(roles, "wait_for_superlink", lambda *args: "the SuperLink cannot be reached")
    else:
        monkeypatch.setattr(roles, "wait_for_superlink", lambda *args: None)
    argv = ["supernodes", "--superlink", "127.0.0.1:9092", "--nodes", "0", "--num-supernodes", "1"]
    if code is None:
        with pytest.raises(RuntimeError, match="could not be started"):
            deploy.main(argv)
    else:
        assert deploy.main(argv) == code
    assert list(tmp_path.iterdir()) == []


def test_a_given_work_dir_is_kept_with_what_was_written_there_and_removed_only_if_made_and_left_empty(
    tmp_path, fresh_temp, monkeypatch
):
    monkeypatch.setattr(roles, "Deployment", NodesStandIn)
    monkeypatch.setattr(roles, "serve", ends("every service exited"))
    monkeypatch.setattr(roles, "wait_for_superlink", lambda *args: None)
    argv = ["supernodes", "--superlink", "127.0.0.1:9092", "--nodes", "0", "--num-supernodes", "1"]
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "work")]) == 1
    assert (tmp_path / "work" / "logs" / "supernode-0.log").exists()
    monkeypatch.setattr(roles, "wait_for_superlink", lambda *args: "the SuperLink cannot be reached")
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "made" / "work")]) == 1
    assert not (tmp_path / "made").exists()  # every level it made, and nothing else
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes").write_text("mine")
    assert deploy.main([*argv, "--work-dir", str(tmp_path / "kept")]) == 1
    assert [path.name for path in (tmp_path / "kept").iterdir()] == ["notes"]
    assert (tmp_path / "kept" / "notes").read_text() == "mine"
    monkeypatch.setattr(roles, "run_superlink_side", lambda args, config, work: 1)  # failed before writing there
    assert deploy.main(["superlink", "--num-supernodes", "1", "--serve"]) == 1
    assert list(fresh_temp.iterdir()) == []


class SuperLinkStandIn:
    """The SuperLink side's deployment that starts nothing but writes a Flower home and a log where the real one
    would, and completes its run."""

    def __init__(self, topology, work, logs):
        self.work, self.logs = work, logs

    def start_superlink_side(self):
        (self.work / "homes" / "superlink").mkdir(parents=True)
        (self.logs / "superlink.log").write_text("started\n")

    def wait_for_supernodes(self, count, timeout_s):
        pass

    def run(self, config):
        (run_folder(config) / "summary.json").write_text(json.dumps({"final-accuracy": 1, "best-accuracy": 1}))
        return "finished:completed", ""

    def stop(self):
        pass


def test_the_superlink_side_keeps_its_logs_with_the_run_or_says_where_and_no_flower_home(
    tmp_path, fresh_temp, monkeypatch, capsys
):
    """A run's logs go to its run folder; serving, to the one folder it leaves in the temporary folder, printed at
    the start; the Flower homes go either way."""
    monkeypatch.setattr(roles, "Deployment", SuperLinkStandIn)
    run = ["--run-config", f'dataset="digits" results-dir="{tmp_path}" run-name="r"']
    assert deploy.main(["superlink", "--num-supernodes", "1", *run]) == 0
    assert (tmp_path / "r" / "logs" / "superlink.log").exists() and list(fresh_temp.iterdir()) == []
    assert f"logs in {tmp_path / 'r' / 'logs'}" in capsys.readouterr().out

    def stopped_by_sigterm(running, after_exits=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("the stop signal did not stop the role")

    monkeypatch.setattr(roles, "serve", stopped_by_sigterm)
    assert deploy.main(["superlink", "--num-supernodes", "1", "--serve"]) == 128 + signal.SIGTERM
    [logs] = fresh_temp.iterdir()
    assert logs.name.startswith("alignfl-superlink-logs-") and [path.name for path in logs.iterdir()] == [
        "superlink.log"
    ]
    assert f"logs in {logs}" in capsys.readouterr().out
