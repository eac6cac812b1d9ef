"""The deployment's topology and the command line of each of its services.

docker-compose.yml runs one SuperLink, N SuperNodes and Flower's ``process``
isolation: a ``flower-superexec`` beside the SuperLink starts each run's
``flwr-serverapp``, and one beside every SuperNode starts its ``flwr-clientapp``
processes. :func:`superlink_command` and its siblings build each service's argv
from a :class:`Topology`: the compose files' (service names, container paths:
:func:`compose_topology`) or loopback's (free ports on 127.0.0.1, a work folder:
:func:`loopback_topology`, which :mod:`fl_app.deployment` starts as local
processes). ``tests/test_deploy.py`` checks that the compose files spell out
exactly these commands.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from fl_app.flwr_cli import PROJECT_ROOT
from fl_app.superlink import free_port

COMPOSE_SUPERLINK_PORT = 9093
COMPOSE_RUNTIME_PORT = 9094
"""SuperNode ``i`` serves its Runtime API (for its executor) on 127.0.0.1:9094 + i."""
COMPOSE_CERTS = "/app/certs"
COMPOSE_NUM_SUPERNODES = 3
MAKE_CERTS = PROJECT_ROOT / "scripts" / "make_certs.sh"


@dataclass(frozen=True)
class Certificates:
    """Where ``scripts/make_certs.sh``'s files are, as the services see them."""

    folder: str

    @property
    def ca(self) -> str:
        return f"{self.folder}/ca.crt"

    @property
    def superlink_cert(self) -> str:
        return f"{self.folder}/superlink.crt"

    @property
    def superlink_key(self) -> str:
        return f"{self.folder}/superlink.key"

    def runtime_cert(self, node: int) -> str:
        return f"{self.folder}/supernode-{node}/runtime.crt"

    def runtime_key(self, node: int) -> str:
        return f"{self.folder}/supernode-{node}/runtime.key"

    def auth_key(self, node: int) -> str:
        return f"{self.folder}/supernode-{node}/auth"

    def auth_public_key(self, node: int) -> str:
        return f"{self.folder}/supernode-{node}/auth.pub"


def make_certificates(folder: Path, num_supernodes: int) -> Path:
    """``scripts/make_certs.sh`` into ``folder`` (existing files are kept): a CA, the SuperLink's certificate and,
    per SuperNode, its Runtime API certificate and authentication key pair, as :class:`Certificates` names them."""
    subprocess.run(["bash", str(MAKE_CERTS), str(folder), str(num_supernodes)], check=True, stdout=subprocess.DEVNULL)
    return folder


@dataclass(frozen=True)
class Topology:
    """The addresses and paths of one deployment: the compose file's (service names, container paths) or
    loopback's (free ports, a work folder). Everything else in the commands is the same for both."""

    num_supernodes: int
    superlink_host: str
    """The interface the SuperLink binds (all of them in a container, 127.0.0.1 here)."""
    superlink_port: int
    superlink_address: str
    """How SuperNodes, the ServerApp executor and ``flwr`` reach the SuperLink (host:port)."""
    runtime_ports: tuple[int, ...]
    """Per SuperNode, the port of its Runtime API on 127.0.0.1 (its executor shares its network)."""
    database: str
    certificates: Certificates | None = None
    """None: plaintext and no SuperNode authentication."""

    def __post_init__(self) -> None:
        if self.num_supernodes < 1:
            raise ValueError(f"num_supernodes must be at least 1, got {self.num_supernodes}")
        if len(self.runtime_ports) < self.num_supernodes:
            raise ValueError(f"{len(self.runtime_ports)} runtime ports for {self.num_supernodes} SuperNodes")


def compose_topology(tls: bool = False, num_supernodes: int = COMPOSE_NUM_SUPERNODES) -> Topology:
    """The values docker-compose.yml (and, with ``tls``, compose.tls.yml) uses."""
    return Topology(
        num_supernodes=num_supernodes, superlink_host="0.0.0.0", superlink_port=COMPOSE_SUPERLINK_PORT,
        superlink_address=f"superlink:{COMPOSE_SUPERLINK_PORT}",
        runtime_ports=tuple(COMPOSE_RUNTIME_PORT + node for node in range(num_supernodes)),
        database="/app/state/superlink.db", certificates=Certificates(COMPOSE_CERTS) if tls else None)


def loopback_topology(num_supernodes: int, work: Path, certificates: Path | None = None) -> Topology:
    """Free ports on 127.0.0.1 and files under ``work``."""
    port = free_port()
    return Topology(
        num_supernodes=num_supernodes, superlink_host="127.0.0.1", superlink_port=port,
        superlink_address=f"127.0.0.1:{port}", runtime_ports=tuple(free_port() for _ in range(num_supernodes)),
        database=str(work / "superlink.db"),
        certificates=Certificates(str(certificates)) if certificates is not None else None)


def _client_security(topology: Topology) -> list[str]:
    """How a client of a Flower API trusts its server: the deployment's CA, or no TLS at all."""
    if topology.certificates is None:
        return ["--insecure"]
    return ["--root-certificates", topology.certificates.ca]


def superlink_command(topology: Topology) -> list[str]:
    """The SuperLink: one HTTP(S) port for the Fleet, Control and Runtime APIs; apps run elsewhere."""
    command = ["flower-superlink", "--isolation", "process", "--host", topology.superlink_host,
               "--port", str(topology.superlink_port), "--database", topology.database]
    certs = topology.certificates
    if certs is None:
        return [*command, "--insecure"]
    return [*command, "--ssl-ca-certfile", certs.ca, "--ssl-certfile", certs.superlink_cert,
            "--ssl-keyfile", certs.superlink_key, "--enable-supernode-auth"]


def serverapp_executor_command(topology: Topology) -> list[str]:
    """The SuperExec that starts each run's ``flwr-serverapp`` process."""
    return ["flower-superexec", "--runtime-api-address", topology.superlink_address, *_client_security(topology)]


def supernode_command(topology: Topology, node: int) -> list[str]:
    """SuperNode ``node``: partition ``node`` of ``num_supernodes``; its Runtime API only on 127.0.0.1."""
    command = ["flower-supernode", "--superlink", topology.superlink_address, "--isolation", "process",
               "--host", "127.0.0.1", "--port", str(topology.runtime_ports[node]),
               "--node-config", f"partition-id={node} num-partitions={topology.num_supernodes}"]
    certs = topology.certificates
    if certs is None:
        return [*command, "--insecure"]
    return [*command, "--root-certificates", certs.ca, "--auth-supernode-private-key", certs.auth_key(node),
            "--ssl-ca-certfile", certs.ca, "--ssl-certfile", certs.runtime_cert(node),
            "--ssl-keyfile", certs.runtime_key(node)]


def clientapp_executor_command(topology: Topology, node: int) -> list[str]:
    """The SuperExec beside SuperNode ``node`` that starts its ``flwr-clientapp`` processes."""
    return ["flower-superexec", "--runtime-api-address", f"127.0.0.1:{topology.runtime_ports[node]}",
            *_client_security(topology)]


def register_command(topology: Topology) -> list[str]:
    """Registers every SuperNode's public key (TLS only: the SuperLink then refuses unknown keys)."""
    certs = topology.certificates
    if certs is None:
        raise ValueError("SuperNode registration needs a topology with certificates (TLS)")
    return ["python", "-m", "fl_app.deploy", "register", "--superlink", topology.superlink_address,
            "--root-certificates", certs.ca,
            *(certs.auth_public_key(node) for node in range(topology.num_supernodes))]
