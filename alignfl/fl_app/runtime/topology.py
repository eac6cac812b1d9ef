"""The deployment's topology and the command line of each of its services.

docker-compose.yml runs one SuperLink, N SuperNodes and Flower's ``process``
isolation: a ``flower-superexec`` beside the SuperLink starts each run's
``flwr-serverapp``, and one beside every SuperNode starts its ClientApp processes
(``warm``, the default: each forked from a warm parent, alignfl/fl_app/patches/warm_superexec.py;
``flower``: Flower's own, a fresh ``flwr-clientapp`` per message); each SuperNode asks
for messages every :data:`DEFAULT_NODE_POLL_S` seconds (alignfl/fl_app/patches/polling_supernode.py;
Flower's own every 3 s). :func:`superlink_command` and its siblings build each service's argv
from a :class:`Topology`: the compose files' (service names, container paths:
:func:`compose_topology`) or loopback's (free ports on 127.0.0.1, a work folder:
:func:`loopback_topology`, which :mod:`alignfl.fl_app.runtime.deployment` starts as local
processes). ``tests/test_deploy_compose.py`` checks that the compose files spell out
exactly these commands.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from alignfl.fl_app.config import ConfigError, path_problem
from alignfl.fl_app.locations import shipped
from alignfl.fl_app.patches.polling_supernode import DEFAULT_NODE_POLL_S, FLOWER_NODE_POLL_S, node_poll_interval
from alignfl.fl_app.runtime.common import free_port

COMPOSE_SUPERLINK_PORT = 9093
COMPOSE_RUNTIME_PORT = 9094
"""SuperNode ``i`` serves its Runtime API (for its executor) on 127.0.0.1:9094 + i."""
COMPOSE_CERTS = "/app/certs"
COMPOSE_NUM_SUPERNODES = 3
MAKE_CERTS = shipped("scripts/make_certs.sh")
EXECUTORS = {
    "warm": ["python", "-m", "alignfl.fl_app.patches.warm_superexec"],
    "flower": ["flower-superexec"],
}
"""How each SuperNode's executor starts its ClientApp processes → the executor's command: ``warm`` forks
each from a process that has imported Flower, torch and the app's dependencies once
(alignfl/fl_app/patches/warm_superexec.py); ``flower`` is Flower's own, a fresh ``flwr-clientapp`` process per
message."""
DEFAULT_EXECUTOR = "warm"


def add_node_options(parser: argparse.ArgumentParser) -> None:
    """``--executor`` and ``--node-poll``: how the SuperNodes of a deployment (or of one machine) run."""
    parser.add_argument(
        "--executor",
        choices=list(EXECUTORS),
        default=DEFAULT_EXECUTOR,
        help="how each SuperNode starts its ClientApp processes: warm (forked from a process that "
        "imported Flower, torch and the app's dependencies once) or flower (Flower's own: a "
        f"fresh flwr-clientapp process per message); default {DEFAULT_EXECUTOR}",
    )
    parser.add_argument(
        "--node-poll",
        type=node_poll_interval,
        default=DEFAULT_NODE_POLL_S,
        metavar="S|flower",
        help="seconds between an idle SuperNode's requests for a message: a wave of messages waits "
        "half of it on average, for 1/S requests a second per idle node (default "
        f"{DEFAULT_NODE_POLL_S:g}); flower: Flower's own SuperNode, every "
        f"{FLOWER_NODE_POLL_S:g} s",
    )


def add_superlink_db_option(parser: argparse.ArgumentParser) -> None:
    """``--superlink-db``: where the SuperLink keeps its state, if not in memory."""
    parser.add_argument(
        "--superlink-db",
        type=Path,
        metavar="FILE",
        help="keep the SuperLink's state (run history, registered SuperNodes) in this SQLite file (a new "
        "path, or an earlier SuperLink's database), to outlive the SuperLink (default: in its memory, which "
        "costs it about a third of the CPU per round)",
    )


SQLITE_HEADER = b"SQLite format 3\x00"
"""The first 16 bytes of every SQLite database file."""


def superlink_db_problem(path: Path) -> str | None:
    """Why ``--superlink-db`` cannot hold the SuperLink's state, or None: it must be a new file in a folder this
    user can write to, or an existing SQLite database (an empty file too: SQLite makes one there) it can read and
    write."""
    if not path.exists():
        problem = path_problem(path.parent, writable=True)
        return None if problem is None else f"its folder cannot hold a new file ({problem})"
    if path.is_dir():
        return "it is a folder; give a file (a new one, or an earlier SuperLink's database)"
    if not os.access(path, os.R_OK | os.W_OK):
        return "this user cannot read and write it"
    with path.open("rb") as file:
        header = file.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER:
        return "it is not an SQLite database (give a new path, or an earlier SuperLink's database)"
    return None


def check_superlink_db(path: Path | None) -> None:
    """Refuse a ``--superlink-db`` that is a folder, not SQLite, unusable, or in a folder that cannot hold it."""
    problem = superlink_db_problem(path.resolve()) if path is not None else None
    if problem is not None:
        raise ConfigError(f"--superlink-db {str(path)!r} is not allowed: {problem}")


def node_poll_option(seconds: float | None) -> str:
    """The ``--node-poll`` value that gives ``seconds`` (as :func:`node_poll_interval` reads it)."""
    return "flower" if seconds is None else f"{seconds:g}"


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


def make_certificates(folder: Path, num_supernodes: int, superlink_sans: str = "") -> Path:
    """``scripts/make_certs.sh`` into ``folder`` (existing files are kept): a CA, the SuperLink's certificate and,
    per SuperNode, its Runtime API certificate and authentication key pair, as :class:`Certificates` names them.
    ``superlink_sans``: more names for the SuperLink's certificate (``IP:10.0.0.1,DNS:fl.example.org``)."""
    made = subprocess.run(
        ["bash", str(MAKE_CERTS), str(folder), str(num_supernodes)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SUPERLINK_SANS": superlink_sans},
    )
    if made.returncode == 2:  # the script refused the folder or the count: its message, never a traceback
        raise ConfigError(made.stderr.strip())
    if made.returncode != 0:
        raise RuntimeError(f"make_certs.sh failed with exit code {made.returncode}: {made.stderr.strip()}")
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
    database: str | None
    """The SuperLink's state (run history, registered SuperNodes) in this SQLite file; None: in its memory, for as
    long as it runs (about a third of the CPU per round: ``benchmarks/deploy_round.py``)."""
    certificates: Certificates | None = None
    """None: plaintext and no SuperNode authentication."""
    executor: str = DEFAULT_EXECUTOR
    """How the SuperNodes' executors start ClientApp processes (a key of :data:`EXECUTORS`)."""
    node_poll_s: float | None = DEFAULT_NODE_POLL_S
    """Seconds between an idle SuperNode's requests for a message; None: Flower's own ``flower-supernode``."""

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor {self.executor!r} is not one of {', '.join(EXECUTORS)}")
        if self.num_supernodes < 1:
            raise ValueError(f"num_supernodes must be at least 1, got {self.num_supernodes}")
        if self.node_poll_s is not None and not 0 < self.node_poll_s <= FLOWER_NODE_POLL_S:
            raise ValueError(f"node_poll_s must be in (0, {FLOWER_NODE_POLL_S:g}], got {self.node_poll_s}")
        if len(self.runtime_ports) < self.num_supernodes:
            raise ValueError(f"{len(self.runtime_ports)} runtime ports for {self.num_supernodes} SuperNodes")


def compose_topology(
    tls: bool = False,
    num_supernodes: int = COMPOSE_NUM_SUPERNODES,
    executor: str = DEFAULT_EXECUTOR,
    node_poll_s: float | None = DEFAULT_NODE_POLL_S,
) -> Topology:
    """The values docker-compose.yml (and, with ``tls``, compose.tls.yml) uses."""
    return Topology(
        num_supernodes=num_supernodes,
        superlink_host="0.0.0.0",
        superlink_port=COMPOSE_SUPERLINK_PORT,
        superlink_address=f"superlink:{COMPOSE_SUPERLINK_PORT}",
        runtime_ports=tuple(COMPOSE_RUNTIME_PORT + node for node in range(num_supernodes)),
        database="/app/state/superlink.db",
        certificates=Certificates(COMPOSE_CERTS) if tls else None,
        executor=executor,
        node_poll_s=node_poll_s,
    )


def loopback_topology(
    num_supernodes: int,
    work: Path,
    certificates: Path | None = None,
    executor: str = DEFAULT_EXECUTOR,
    node_poll_s: float | None = DEFAULT_NODE_POLL_S,
    superlink_db: Path | None = None,
) -> Topology:
    """Free ports on 127.0.0.1 and files under ``work``; the SuperLink's state in memory unless ``superlink_db``
    (the deployment lives for one run, whose checkpoints, not the SuperLink's state, resume it)."""
    port = free_port()
    return Topology(
        num_supernodes=num_supernodes,
        superlink_host="127.0.0.1",
        superlink_port=port,
        superlink_address=f"127.0.0.1:{port}",
        runtime_ports=tuple(free_port() for _ in range(num_supernodes)),
        database=str(superlink_db) if superlink_db is not None else None,
        certificates=Certificates(str(certificates)) if certificates is not None else None,
        executor=executor,
        node_poll_s=node_poll_s,
    )


def _client_security(topology: Topology) -> list[str]:
    """How a client of a Flower API trusts its server: the deployment's CA, or no TLS at all."""
    if topology.certificates is None:
        return ["--insecure"]
    return ["--root-certificates", topology.certificates.ca]


def superlink_command(topology: Topology) -> list[str]:
    """The SuperLink: one HTTP(S) port for the Fleet, Control and Runtime APIs; apps run elsewhere."""
    state = ["--database", topology.database] if topology.database else []
    command = [
        "flower-superlink",
        "--isolation",
        "process",
        "--host",
        topology.superlink_host,
        "--port",
        str(topology.superlink_port),
        *state,
    ]
    certs = topology.certificates
    if certs is None:
        return [*command, "--insecure"]
    return [
        *command,
        "--ssl-ca-certfile",
        certs.ca,
        "--ssl-certfile",
        certs.superlink_cert,
        "--ssl-keyfile",
        certs.superlink_key,
        "--enable-supernode-auth",
    ]


def serverapp_executor_command(topology: Topology) -> list[str]:
    """The SuperExec that starts each run's ``flwr-serverapp`` process."""
    return ["flower-superexec", "--runtime-api-address", topology.superlink_address, *_client_security(topology)]


def supernode_entry_point(topology: Topology) -> list[str]:
    """A SuperNode's program (the compose files' ``entrypoint``): Flower's, or the one that polls faster."""
    return (
        ["flower-supernode"]
        if topology.node_poll_s is None
        else ["python", "-m", "alignfl.fl_app.patches.polling_supernode"]
    )


def supernode_command(topology: Topology, node: int) -> list[str]:
    """SuperNode ``node``: partition ``node`` of ``num_supernodes``; its Runtime API only on 127.0.0.1."""
    poll = [] if topology.node_poll_s is None else ["--poll-interval", node_poll_option(topology.node_poll_s)]
    command = [
        *supernode_entry_point(topology),
        *poll,
        "--superlink",
        topology.superlink_address,
        "--isolation",
        "process",
        "--host",
        "127.0.0.1",
        "--port",
        str(topology.runtime_ports[node]),
        "--node-config",
        f"partition-id={node} num-partitions={topology.num_supernodes}",
    ]
    certs = topology.certificates
    if certs is None:
        return [*command, "--insecure"]
    return [
        *command,
        "--root-certificates",
        certs.ca,
        "--auth-supernode-private-key",
        certs.auth_key(node),
        "--ssl-ca-certfile",
        certs.ca,
        "--ssl-certfile",
        certs.runtime_cert(node),
        "--ssl-keyfile",
        certs.runtime_key(node),
    ]


def clientapp_executor_command(topology: Topology, node: int) -> list[str]:
    """The SuperExec beside SuperNode ``node`` that starts its ClientApp processes (as ``topology.executor``)."""
    return [
        *EXECUTORS[topology.executor],
        "--runtime-api-address",
        f"127.0.0.1:{topology.runtime_ports[node]}",
        *_client_security(topology),
    ]


def register_command(topology: Topology) -> list[str]:
    """Registers every SuperNode's public key (TLS only: the SuperLink then refuses unknown keys)."""
    certs = topology.certificates
    if certs is None:
        raise ValueError("SuperNode registration needs a topology with certificates (TLS)")
    return [
        "python",
        "-m",
        "alignfl.fl_app.deploy",
        "register",
        "--superlink",
        topology.superlink_address,
        "--root-certificates",
        certs.ca,
        *(certs.auth_public_key(node) for node in range(topology.num_supernodes)),
    ]
