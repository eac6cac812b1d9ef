"""The deployment's roles for real machines (fast parts): the SuperLink's certificate for the names nodes dial,
a node's check of the SuperLink before it starts, and options refused before anything starts. The roles run
across three network namespaces in scripts/hosts_check.sh."""

import shutil
import socket
import ssl
import threading

import pytest

from fl_app.runtime import deploy, roles
from fl_app.runtime.common import free_port
from fl_app.runtime.roles import (
    RefusedKeys,
    Unreachable,
    certificate_names,
    parser_for,
    subject_names,
    superlink_certificates,
    supernodes_topology,
    tls_problem,
    wait_for_tls,
)
from fl_app.runtime.topology import make_certificates


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
    assert "cannot be reached" in wait_for_tls(f"127.0.0.1:{closed}", str(certs / "ca.crt"), timeout_s=1.0)


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
