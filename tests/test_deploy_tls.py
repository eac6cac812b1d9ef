"""The loopback deployment with TLS and SuperNode authentication (slow): two authorised SuperNodes train, a third
whose key was never registered is refused, and every port the deployment listens on speaks TLS only."""

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from alignfl.fl_app.runtime.common import free_port
from alignfl.fl_app.runtime.deployment import deployment
from alignfl.fl_app.runtime.flwr_cli import online_supernodes
from alignfl.fl_app.runtime.superlink import trust
from alignfl.fl_app.runtime.topology import loopback_topology, make_certificates, supernode_command
from tests.deployments import RUN_TIMEOUT_S, private_home, rows, run_config, run_to_end


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory) -> Iterator[Path]:
    """A home folder of their own for the services: their clients keep state under ~/.cache/alignfl."""
    yield from private_home(tmp_path_factory)


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
