"""The deployment across machines: one machine runs the SuperLink side, others run their SuperNodes.

``python -m alignfl.fl_app.deploy`` starts every service on one machine. Across machines it takes a role:

    # the SuperLink's machine: SuperLink, the ServerApp's executor, TLS for the names the nodes dial,
    # every node's key registered (in ~/.local/state/alignfl/certs); listens on 10.0.0.1 only; runs one
    # experiment once the nodes are online (or --serve)
    python -m alignfl.fl_app.deploy superlink --address 10.0.0.1 --num-supernodes 2 --tls --rounds 5
    # each node machine, with a copy of that folder's ca.crt and supernode-<i>/ in ~/alignfl-certs
    python -m alignfl.fl_app.deploy supernodes --superlink 10.0.0.1:9093 --nodes 1 --num-supernodes 2 --tls \
        --certs ~/alignfl-certs

The SuperLink side listens only where it is told: on ``--host``, else on the one address of this machine that
``--address`` names (127.0.0.1 without ``--address``), never on every interface unless ``--host 0.0.0.0`` says so
(with a warning when TLS is off). It makes the certificate for the names and addresses given with ``--address``
(through ``scripts/make_certs.sh``'s ``SUPERLINK_SANS``) in ``--certs`` (default
:func:`alignfl.fl_app.runtime.keys.default_certs`, outside the checkout) and refuses a kept certificate that lacks one.
A node machine first waits for the SuperLink to answer (:mod:`alignfl.fl_app.runtime.reach`), saying so on the console
while it does not, and with TLS checks that its certificate names the address dialled, and stops at once with the
reason when it does not (Flower's SuperNode would retry without end); a node whose key the SuperLink does not know
yet (a node machine started before the SuperLink's machine registered it) is started again every few seconds until
``--superlink-wait`` runs out (Flower's SuperNode would exit). Both stop every process they started, by process
id, on Ctrl-C, SIGTERM or SIGHUP; a node machine serves until then. Without ``--work-dir`` they leave nothing in the
system's temporary folder but a serving SuperLink's logs: the Flower homes go however a role ends, a run's logs go
to its run folder, a node machine's with it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from cryptography import x509

from alignfl.core.data import DatasetMissingError
from alignfl.fl_app.config import ConfigError, RunConfig
from alignfl.fl_app.locations import checkout_root, program
from alignfl.fl_app.patches.polling_supernode import FLOWER_NODE_POLL_S
from alignfl.fl_app.runtime.common import check_folder, free_port, made_folder, work_folder
from alignfl.fl_app.runtime.deployment import Deployment, run_logs
from alignfl.fl_app.runtime.flwr_cli import parse_overrides
from alignfl.fl_app.runtime.keys import default_certs, refuse_committable_folder, refuse_exposed_keys
from alignfl.fl_app.runtime.launch import prepare_config, report_outcome
from alignfl.fl_app.runtime.processes import Stopped, stop_signals
from alignfl.fl_app.runtime.reach import ALL_INTERFACES, listen_host, split_address, wait_for_superlink
from alignfl.fl_app.runtime.topology import (
    COMPOSE_SUPERLINK_PORT,
    Certificates,
    Topology,
    add_node_options,
    add_superlink_db_option,
    check_superlink_db,
    make_certificates,
)

SERVE_INTERVAL_S = 1.0
REJOIN_INTERVAL_S = 5.0
"""Seconds before a SuperNode whose key the SuperLink refused is started again (see :class:`RefusedKeys`)."""
KEY_REFUSED = "Failed to activate SuperNode"
"""What Flower's SuperNode logs (``[code: 2004]``, exit code 305) when the SuperLink does not know its key."""


def subject_names(addresses: list[str]) -> str:
    """``make_certs.sh``'s ``SUPERLINK_SANS`` for these names: ``IP:`` for addresses, ``DNS:`` for host names."""
    names = []
    for address in addresses:
        try:
            names.append(f"IP:{ipaddress.ip_address(address)}")
        except ValueError:
            names.append(f"DNS:{address}")
    return ",".join(names)


def certificate_names(certificate: Path) -> set[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    names = (
        x509.load_pem_x509_certificate(certificate.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    return {*names.get_values_for_type(x509.DNSName), *(str(ip) for ip in names.get_values_for_type(x509.IPAddress))}


def superlink_certificates(folder: Path, num_supernodes: int, addresses: list[str]) -> Path:
    """make_certs.sh's files in ``folder``, the SuperLink's certificate naming every address; a certificate
    kept from before that lacks one is refused (make_certs.sh keeps existing files)."""
    make_certificates(folder, num_supernodes, subject_names(addresses))
    named = certificate_names(folder / "superlink.crt")
    missing = [address for address in addresses if _canonical(address) not in named]
    if missing:
        raise ConfigError(
            f"--certs {str(folder)!r}: its superlink.crt (kept from before) does not name "
            f"{', '.join(missing)} (it names {', '.join(sorted(named))}); remove superlink.crt and "
            "superlink.key there to make a new one, or give another --certs folder"
        )
    return folder


def _canonical(address: str) -> str:
    """An IP address as a certificate lists it (``::1``, not ``0:0::1``); a host name as it is."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return address


def superlink_topology(args: argparse.Namespace, work: Path, certs: Path | None) -> Topology:
    """The SuperLink side bound to ``--host``; its own executor and CLI dial it locally."""
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return Topology(
        num_supernodes=args.num_supernodes,
        superlink_host=args.host,
        superlink_port=args.port,
        superlink_address=f"{local}:{args.port}",
        runtime_ports=(0,) * args.num_supernodes,
        database=str(args.superlink_db.resolve()) if args.superlink_db else None,
        certificates=Certificates(str(certs)) if certs is not None else None,
    )


def supernodes_topology(args: argparse.Namespace, certs: Path | None) -> Topology:
    """This machine's SuperNodes (their Runtime APIs on free loopback ports) against ``--superlink``."""
    host, port = split_address(args.superlink, "--superlink")
    ports = tuple(free_port() if node in args.nodes else 0 for node in range(args.num_supernodes))
    return Topology(
        num_supernodes=args.num_supernodes,
        superlink_host=host,
        superlink_port=port,
        superlink_address=args.superlink,
        runtime_ports=ports,
        database=None,
        certificates=Certificates(str(certs)) if certs is not None else None,
        executor=args.executor,
        node_poll_s=args.node_poll,
    )


def node_files_missing(certs: Certificates, nodes: list[int]) -> list[str]:
    """The files a node machine's SuperNodes read with TLS that ``certs`` lacks."""
    needed = [certs.ca] + [
        path for node in nodes for path in (certs.auth_key(node), certs.runtime_cert(node), certs.runtime_key(node))
    ]
    return [path for path in needed if not Path(path).is_file()]


def parser_for(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program("alignfl.fl_app.deploy", role), description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--num-supernodes",
        type=int,
        required=True,
        help="SuperNodes of the whole deployment (num-partitions); with --tls, each one's key",
    )
    parser.add_argument("--tls", action="store_true", help="TLS on every API and SuperNode authentication")
    parser.add_argument(
        "--certs",
        type=Path,
        help="make_certs.sh's folder (superlink: made or completed there, default "
        f"{default_certs()}, outside the checkout; supernodes: required with --tls)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where the services' logs and Flower homes go, and stay (default: the homes in a temporary folder "
        + (
            "removed at the end, the logs in the run folder's logs/, or with --serve in a temporary folder printed "
            "at the start)"
            if role == "superlink"
            else "removed at the end with the logs)"
        ),
    )
    if role == "superlink":
        parser.add_argument(
            "--host",
            help="the address the SuperLink listens on (default: the one address of this machine that --address "
            "names; 127.0.0.1 without --address); 0.0.0.0 listens on every interface",
        )
        parser.add_argument(
            "--port", type=int, default=COMPOSE_SUPERLINK_PORT, help=f"its port (default {COMPOSE_SUPERLINK_PORT})"
        )
        parser.add_argument(
            "--address",
            action="append",
            default=[],
            help="a host name or address the SuperNodes dial (repeatable; with --tls the "
            "SuperLink's certificate names each)",
        )
        parser.add_argument(
            "--serve",
            action="store_true",
            help="keep the SuperLink up until stopped (run experiments with flwr run) instead of "
            "running one experiment",
        )
        parser.add_argument("--run-config", default="", help="'key=value ...' overrides of [tool.flwr.app.config]")
        parser.add_argument("--rounds", type=int, help="shorthand for the run-config key num-server-rounds")
        add_superlink_db_option(parser)
        parser.add_argument(
            "--node-wait",
            type=float,
            default=600.0,
            help="seconds to wait for --num-supernodes SuperNodes before the run (default 600)",
        )
    else:
        parser.add_argument(
            "--superlink", required=True, help="the SuperLink's address as this machine dials it, host:port"
        )
        parser.add_argument(
            "--nodes", type=int, nargs="+", required=True, help="the partition ids of this machine's SuperNodes"
        )
        parser.add_argument(
            "--superlink-wait",
            type=float,
            default=600.0,
            help="seconds to wait for the SuperLink to answer (and with --tls to accept these nodes' keys) "
            "before giving up (a certificate that does not name --superlink stops the nodes at once); "
            "default 600",
        )
        add_node_options(parser)
    return parser


def check(role: str, args: argparse.Namespace) -> RunConfig | None:
    """Every option checked before anything starts (a ConfigError naming it); the superlink's run config."""
    if args.num_supernodes < 1:
        raise ConfigError(f"--num-supernodes must be at least 1, got {args.num_supernodes}")
    if args.certs is not None and not args.tls:
        raise ConfigError("--certs is only used with --tls")
    for option, folder in (("--work-dir", args.work_dir), ("--certs", args.certs if role == "superlink" else None)):
        if folder is not None:
            check_folder(option, folder.resolve())
    check_superlink_db(getattr(args, "superlink_db", None))
    refuse_exposed_keys(checkout_root(), (args.certs or default_certs()) if args.tls else None)
    if role == "supernodes":
        split_address(args.superlink, "--superlink")
        if not args.superlink_wait > 0:
            raise ConfigError(f"--superlink-wait {args.superlink_wait} is not allowed: seconds > 0")
        wrong = [node for node in args.nodes if not 0 <= node < args.num_supernodes]
        if wrong or len(set(args.nodes)) != len(args.nodes):
            raise ConfigError(
                f"--nodes {args.nodes} is not allowed: distinct partition ids in "
                f"[0, --num-supernodes={args.num_supernodes})"
            )
        if args.tls:
            if args.certs is None:
                raise ConfigError(
                    "--tls on a node machine needs --certs: a folder with the deployment's ca.crt and "
                    "supernode-<i>/ (auth, runtime.crt, runtime.key) of its nodes"
                )
            missing = node_files_missing(Certificates(str(args.certs.resolve())), args.nodes)
            if missing:
                raise ConfigError(f"--certs {str(args.certs)!r} lacks {', '.join(missing)}")
        return None
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not allowed: 1-65535")
    args.host = listen_host(args.host, args.address)
    if args.tls:
        refuse_committable_folder("--certs", args.certs or default_certs())  # the SuperLink side makes keys there
    if args.tls and not args.address:
        raise ConfigError(
            "--tls needs --address: the names or addresses the SuperNodes dial, which the "
            "SuperLink's certificate must name"
        )
    if args.node_wait <= 0:
        raise ConfigError(f"--node-wait {args.node_wait} is not allowed: seconds > 0")
    if args.serve:
        if args.run_config or args.rounds is not None:
            raise ConfigError("--serve runs no experiment: --run-config and --rounds are not used with it")
        return None
    overrides = parse_overrides(args.run_config)
    if args.rounds is not None:
        overrides["num-server-rounds"] = args.rounds
    return prepare_config(overrides, args.num_supernodes)


def role_main(role: str, argv: list[str]) -> int:
    """``python -m alignfl.fl_app.deploy superlink|supernodes ...``; the exit code."""
    args = parser_for(role).parse_args(argv)
    try:
        with stop_signals():
            try:
                config = check(role, args)
            except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
                print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
                return 2
            if role == "superlink" and args.host in ALL_INTERFACES and not args.tls:
                print(
                    f"[alignfl] warning: a plaintext SuperLink on every interface ({args.host}): whoever reaches "
                    "this machine can join the federation as a SuperNode and read the models; use --tls, or "
                    "--host with an address only the nodes reach",
                    file=sys.stderr,
                    flush=True,
                )
            with work_folder(args.work_dir, f"alignfl-{role}-") as work:
                if role == "superlink":
                    return run_superlink_side(args, config, work)
                return run_supernodes(args, work)
    except Stopped as stop:
        print(f"[alignfl] stopped by {stop}: every process this {role} role started has been stopped", file=sys.stderr)
        return stop.exit_code
    except ConfigError as error:
        print(f"[alignfl] refused: {error}", file=sys.stderr)
        return 2


@contextmanager
def superlink_logs(args: argparse.Namespace, config: RunConfig | None, work: Path) -> Iterator[Path]:
    """Where the SuperLink side's logs go: ``logs`` of ``--work-dir``; else beside the run's results
    (:func:`alignfl.fl_app.runtime.deployment.run_logs`), or, serving with no run of its own, a folder
    ``alignfl-superlink-logs-*`` of the system's temporary folder, the one thing the role leaves there (removed
    when it stays empty); the temporary ``work`` with the Flower homes goes however the role ends."""
    if args.work_dir is not None:
        logs = work / "logs"
    elif config is not None:
        logs = run_logs(config)
    else:
        logs = Path(tempfile.gettempdir()) / f"alignfl-superlink-logs-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    with made_folder(logs) as folder:
        yield folder


def run_superlink_side(args: argparse.Namespace, config: RunConfig | None, work: Path) -> int:
    certs = None
    if args.tls:
        certs = superlink_certificates((args.certs or default_certs()).resolve(), args.num_supernodes, args.address)
    with superlink_logs(args, config, work) as logs:
        running = Deployment(superlink_topology(args, work, certs), work, logs)
        try:
            running.start_superlink_side()
            dialled = args.address[0] if args.address else "<this host>"
            security = f" --tls --certs <a copy of ca.crt and supernode-<i>/ from {certs}>" if certs else ""
            mode = "TLS + SuperNode authentication" if certs else "plaintext"
            print(
                f"[alignfl] SuperLink on {args.host}:{args.port} ({mode}); logs in {logs}. On each node "
                f"machine:\n  python -m alignfl.fl_app.deploy supernodes --superlink "
                f"{dialled}:{args.port} --nodes <i ...> --num-supernodes {args.num_supernodes}{security}",
                flush=True,
            )
            if config is None:
                return serve(running)
            running.wait_for_supernodes(args.num_supernodes, args.node_wait)
            status, details = running.run(config)
        except (RuntimeError, TimeoutError) as error:
            print(f"[alignfl] SuperLink side FAILED: {error}; logs in {logs}", file=sys.stderr)
            return 1
        finally:
            running.stop()
    return report_outcome(config, status, details)


class RefusedKeys:
    """Node machines are often started before the SuperLink's machine has registered their keys; Flower's SuperNode
    then exits at once ("Failed to activate SuperNode"). Each such node is started again every
    :data:`REJOIN_INTERVAL_S` seconds until ``deadline``; after it, the node stays down with what to do."""

    def __init__(self, running: Deployment, nodes: list[int], deadline: float) -> None:
        self.running, self.nodes, self.deadline = running, nodes, deadline
        self.given_up: set[int] = set()

    def refused(self, node: int) -> bool:
        name = f"supernode-{node}"
        return name in self.running.exited and KEY_REFUSED in self.running.log_tail(name, 40)

    def __call__(self) -> None:
        for node in self.nodes:
            if node in self.given_up or not self.refused(node):
                continue
            certs = self.running.topology.certificates
            public_key = certs.auth_public_key(node) if certs is not None else f"supernode-{node}/auth.pub"
            if time.monotonic() > self.deadline:
                self.given_up.add(node)
                print(
                    f"[alignfl] the SuperLink still refuses supernode-{node}'s key; gave up (--superlink-wait). "
                    f"Register {public_key} on the SuperLink's machine (python -m alignfl.fl_app.deploy superlink "
                    f"--num-supernodes N registers supernode-0 ... N-1), then start this machine again",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            print(
                f"[alignfl] the SuperLink does not accept supernode-{node}'s key (not registered yet?); starting "
                f"it again in {REJOIN_INTERVAL_S:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(REJOIN_INTERVAL_S)
            self.running.restart_node(node)


def run_supernodes(args: argparse.Namespace, work: Path) -> int:
    certs = args.certs.resolve() if args.certs is not None else None
    topology = supernodes_topology(args, certs)
    started = time.monotonic()
    ca = topology.certificates.ca if topology.certificates is not None else None
    problem = wait_for_superlink(args.superlink, ca, args.superlink_wait)
    if problem is not None:
        problem += f" (checked in {time.monotonic() - started:.1f} s)"
        print(f"[alignfl] SuperNodes not started: {problem}", file=sys.stderr)
        return 1
    running = Deployment(topology, work)
    try:
        running.start_supernodes(sorted(args.nodes))
        print(
            f"[alignfl] SuperNodes {', '.join(map(str, sorted(args.nodes)))} of {args.num_supernodes} dialling "
            f"{args.superlink} ({args.executor} executor, polling every "
            f"{args.node_poll or FLOWER_NODE_POLL_S:g} s); logs in {work / 'logs'}"
            f"{'' if args.work_dir else ' (removed on exit: --work-dir keeps them)'}; Ctrl-C stops them",
            flush=True,
        )
        return serve(running, RefusedKeys(running, sorted(args.nodes), time.monotonic() + args.superlink_wait))
    finally:
        running.stop()


def serve(running: Deployment, after_exits: Callable[[], None] | None = None) -> int:
    """Report services that exit (then ``after_exits``) until a stop signal (raised as Stopped); 1 once every
    service has exited."""
    while True:
        running.report_exits()
        if after_exits is not None:
            after_exits()
        if len(running.exited) == len(running.services):
            print("[alignfl] every service has exited", file=sys.stderr)
            return 1
        time.sleep(SERVE_INTERVAL_S)
