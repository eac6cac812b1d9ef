"""docker-compose.yml's deployment as local processes on 127.0.0.1: run one experiment on it.

The compose file runs one SuperLink, N SuperNodes and Flower's ``process``
isolation: a ``flower-superexec`` beside the SuperLink starts each run's
``flwr-serverapp``, and one beside every SuperNode starts its ClientApp processes
(``--executor warm``, the default: each forked from a warm parent, see
fl_app/warm_superexec.py; ``flower``: Flower's own, a fresh ``flwr-clientapp`` per
message). This module holds the command line of every one of those services
(:func:`superlink_command` and its siblings); the compose files spell out the
same argv for the container addresses and paths (:func:`compose_topology`), and
``tests/test_deploy.py`` checks they agree. ``python -m fl_app.deploy`` starts
the services on free loopback ports (with ``--tls``: TLS everywhere and
SuperNode authentication, keys from ``scripts/make_certs.sh``), waits until every
SuperNode is online, submits the run with ``flwr run``, streams its log, reads
its final status, and stops every process it started by process id, also on
Ctrl-C, SIGTERM, SIGHUP or failure. Its exit code is the run's outcome.

While the run goes on it watches the services: one that exits is reported at once
(name, exit code, log file). A SuperNode and its executor go down together (one
without the other cannot answer), and the run goes on with the other nodes. When
the SuperLink exits the run cannot go on: everything is stopped, and the command
that continues the run from its checkpoint (``resume-from``) is printed.

    python -m fl_app.deploy --num-supernodes 3 --run-config 'dataset="digits" num-server-rounds=2'

``python -m fl_app.deploy register`` registers SuperNode public keys with a
SuperLink that has ``--enable-supernode-auth`` (the compose TLS override's
one-shot service runs it).

A SuperNode that dies is noticed through its heartbeats: Flower 1.41's SuperNode
sends one every 30 s and the SuperLink marks it offline after two missed
(``HEARTBEAT_DEFAULT_INTERVAL`` × ``HEARTBEAT_PATIENCE``, not configurable), and
then answers the messages sent to it with an error reply, so a round that
sampled a dead node goes on without it at most about a minute later; later rounds
sample only the nodes online (round 1 waits for ``min-available-nodes``, at most
``node-wait-timeout`` seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from flwr.supercore.error import ApiErrorCode

from fl_app.config import ConfigError, RunConfig, default_run_config, path_problem
from core.data import DatasetMissingError
from fl_app.launch import (
    PROJECT_ROOT,
    ProcessTree,
    Stopped,
    checkpointed_round,
    exit_description,
    flower_environment,
    flwr_cli,
    free_port,
    healthy,
    log_tail,
    parse_overrides,
    prepare_config,
    process_table,
    report_outcome,
    run_folder,
    start_process,
    stop_processes,
    stop_signals,
    submit_and_follow,
    to_toml_pairs,
)

CONNECTION = "alignfl-deployment"
"""The ``flwr`` CLI's name for the deployment's SuperLink (in the Flower home's ``config.toml``)."""
COMPOSE_SUPERLINK_PORT = 9093
COMPOSE_RUNTIME_PORT = 9094
"""SuperNode ``i`` serves its Runtime API (for its executor) on 127.0.0.1:9094 + i."""
COMPOSE_CERTS = "/app/certs"
COMPOSE_NUM_SUPERNODES = 3
MAKE_CERTS = PROJECT_ROOT / "scripts" / "make_certs.sh"
STARTUP_TIMEOUT_S = 240.0
EXECUTORS = {
    "warm": ["python", "-m", "fl_app.warm_superexec"],
    "flower": ["flower-superexec"],
}
"""How each SuperNode's executor starts its ClientApp processes → the executor's command: ``warm`` forks
each from a process that has imported Flower, torch and the app's dependencies once (fl_app/warm_superexec.py);
``flower`` is Flower's own, a fresh ``flwr-clientapp`` process per message."""
DEFAULT_EXECUTOR = "warm"


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
    executor: str = DEFAULT_EXECUTOR
    """How the SuperNodes' executors start ClientApp processes (a key of :data:`EXECUTORS`)."""

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor {self.executor!r} is not one of {', '.join(EXECUTORS)}")
        if self.num_supernodes < 1:
            raise ValueError(f"num_supernodes must be at least 1, got {self.num_supernodes}")
        if len(self.runtime_ports) < self.num_supernodes:
            raise ValueError(f"{len(self.runtime_ports)} runtime ports for {self.num_supernodes} SuperNodes")


def compose_topology(tls: bool = False, num_supernodes: int = COMPOSE_NUM_SUPERNODES,
                     executor: str = DEFAULT_EXECUTOR) -> Topology:
    """The values docker-compose.yml (and, with ``tls``, compose.tls.yml) uses."""
    return Topology(
        num_supernodes=num_supernodes, superlink_host="0.0.0.0", superlink_port=COMPOSE_SUPERLINK_PORT,
        superlink_address=f"superlink:{COMPOSE_SUPERLINK_PORT}",
        runtime_ports=tuple(COMPOSE_RUNTIME_PORT + node for node in range(num_supernodes)),
        database="/app/state/superlink.db", certificates=Certificates(COMPOSE_CERTS) if tls else None,
        executor=executor)


def loopback_topology(num_supernodes: int, work: Path, certificates: Path | None = None,
                      executor: str = DEFAULT_EXECUTOR) -> Topology:
    """Free ports on 127.0.0.1 and files under ``work``."""
    port = free_port()
    return Topology(
        num_supernodes=num_supernodes, superlink_host="127.0.0.1", superlink_port=port,
        superlink_address=f"127.0.0.1:{port}", runtime_ports=tuple(free_port() for _ in range(num_supernodes)),
        database=str(work / "superlink.db"),
        certificates=Certificates(str(certificates)) if certificates is not None else None, executor=executor)


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
    """The SuperExec beside SuperNode ``node`` that starts its ClientApp processes (as ``topology.executor``)."""
    return [*EXECUTORS[topology.executor], "--runtime-api-address", f"127.0.0.1:{topology.runtime_ports[node]}",
            *_client_security(topology)]


def register_command(topology: Topology) -> list[str]:
    """Registers every SuperNode's public key (TLS only: the SuperLink then refuses unknown keys)."""
    certs = topology.certificates
    if certs is None:
        raise ValueError("SuperNode registration needs a topology with certificates (TLS)")
    return ["python", "-m", "fl_app.deploy", "register", "--superlink", topology.superlink_address,
            "--root-certificates", certs.ca,
            *(certs.auth_public_key(node) for node in range(topology.num_supernodes))]


def write_connection(flwr_home: Path, address: str, root_certificates: str | None) -> None:
    """The ``flwr`` CLI's config: the deployment's SuperLink as the default connection."""
    security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n{security}\n')


def health_url(address: str, root_certificates: str | None) -> str:
    return f"{'https' if root_certificates else 'http'}://{address}/health"


def trust(root_certificates: str | None) -> ssl.SSLContext | bool:
    """How an HTTP client verifies the deployment's servers: by its CA (or the system's store)."""
    return ssl.create_default_context(cafile=root_certificates) if root_certificates else True


def register_supernodes(public_keys: Sequence[str], env: dict[str, str]) -> None:
    """``flwr supernode register`` each key; a key registered before (a restarted deployment) is fine."""
    already = f"[code: {int(ApiErrorCode.PUBLIC_KEY_ALREADY_IN_USE)}]"
    for key in public_keys:
        done = flwr_cli(["supernode", "register", key, CONNECTION, "--format", "json"], env)
        try:
            reply = json.loads(done.stdout)
        except json.JSONDecodeError:
            reply = {"error-message": done.stdout + done.stderr}
        if not reply.get("success") and already not in reply.get("error-message", ""):
            raise RuntimeError(f"could not register SuperNode key {key}: {reply.get('error-message', '').strip()}")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 1.0) -> None:
    """Poll ``condition`` until it holds; a clear error naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def online_supernodes(env: dict[str, str]) -> int:
    """How many SuperNodes the SuperLink sees online (``flwr supernode ls``)."""
    listing = flwr_cli(["supernode", "list", "--format", "json"], env)
    try:
        return sum(node["status"] == "online" for node in json.loads(listing.stdout)["nodes"])
    except (json.JSONDecodeError, KeyError):
        return 0


def partner_of(service: str) -> str | None:
    """The other half of a node: ``supernode-<i>`` and ``superexec-clientapp-<i>``."""
    for one, other in (("supernode-", "superexec-clientapp-"), ("superexec-clientapp-", "supernode-")):
        if service.startswith(one):
            return other + service.removeprefix(one)
    return None


def resume_command(config: RunConfig, num_supernodes: int, tls: bool, executor: str = DEFAULT_EXECUTOR) -> str:
    """The ``deploy.sh`` command that continues ``config``'s run from its checkpoint on a new deployment of
    the same shape (with TLS, on keys made afresh): the run's keys that differ from their defaults, and
    ``resume-from`` its folder."""
    defaults = default_run_config()
    values = {key: value for key, value in config.to_run_config().items()
              if key not in ("run-name", "resume-from") and value != defaults.get(key)}
    values["resume-from"] = str(run_folder(config))
    command = [str(PROJECT_ROOT / "scripts" / "deploy.sh"), "--num-supernodes", str(num_supernodes)]
    options = [*(["--tls"] if tls else []), *(["--executor", executor] if executor != DEFAULT_EXECUTOR else [])]
    return shlex.join([*command, *options, "--run-config", to_toml_pairs(values)])


def resume_advice(config: RunConfig, num_supernodes: int, tls: bool, executor: str = DEFAULT_EXECUTOR) -> str:
    """How to continue a run that stopped early, from its last checkpoint."""
    done = checkpointed_round(config)
    if done is None:
        return "the run checkpointed no round, so it must start again"
    return (f"rounds up to {done} are checkpointed in {run_folder(config)}; continue the run with:\n  "
            f"{resume_command(config, num_supernodes, tls, executor)}")


@dataclass
class Deployment:
    """The loopback deployment's processes, started in the compose file's order, each with every process it
    starts (its executor's app processes), so stopping one stops what it started."""

    topology: Topology
    work: Path
    services: dict[str, ProcessTree] = field(default_factory=dict)
    exited: dict[str, str] = field(default_factory=dict)
    """Service → how it ended (``signal SIGKILL``, ``code 1``, ``stopped with supernode-2``), for every service
    that ended while a run went on."""

    @property
    def ca(self) -> str | None:
        return self.topology.certificates.ca if self.topology.certificates else None

    def environment(self, service: str) -> dict[str, str]:
        """Each service has its own Flower home, as it would on its own machine."""
        return flower_environment(self.work / "homes" / service)

    @property
    def cli_environment(self) -> dict[str, str]:
        return self.environment("cli")

    def log_file(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def start_service(self, name: str, command: list[str]) -> ProcessTree:
        self.log_file(name).parent.mkdir(parents=True, exist_ok=True)
        with self.log_file(name).open("wb") as log_file:
            tree = start_process(command, self.environment(name), self.work, stdout=log_file,
                                 stderr=subprocess.STDOUT)
        self.services[name] = tree
        return tree

    def log_tail(self, name: str, lines: int = 15) -> str:
        return log_tail(self.log_file(name), lines)

    def running_and(self, condition: Callable[[], bool]) -> Callable[[], bool]:
        """``condition`` for :func:`wait_until`, but first an error with the log of a service that died."""
        def check() -> bool:
            for name, tree in self.services.items():
                if tree.process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {exit_description(tree.process.returncode)}; the end "
                                       f"of its log ({self.log_file(name)}):\n{self.log_tail(name)}")
            return condition()
        return check

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """SuperLink, its executor, (with TLS: key registration,) SuperNodes and their executors; returns once
        every SuperNode is online, so the first round samples all of them."""
        self.start_superlink_side(timeout_s)
        self.start_supernodes(range(self.topology.num_supernodes))
        self.wait_for_supernodes(self.topology.num_supernodes, timeout_s)

    def start_superlink_side(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """SuperLink and its executor, (with TLS:) every SuperNode's key registered; the ``flwr`` CLI's
        connection written. Returns once the SuperLink answers."""
        topology = self.topology
        write_connection(self.work / "homes" / "cli", topology.superlink_address, self.ca)
        self.start_service("superlink", superlink_command(topology))
        url = health_url(topology.superlink_address, self.ca)
        verify = trust(self.ca)
        wait_until(self.running_and(lambda: healthy(url, verify)), timeout_s, f"the SuperLink at {url}")
        self.start_service("superexec-serverapp", serverapp_executor_command(topology))
        if topology.certificates is not None:
            register_supernodes([topology.certificates.auth_public_key(node) for node in range(topology.num_supernodes)],
                                self.cli_environment)

    def start_supernodes(self, nodes: Iterable[int]) -> None:
        """These SuperNodes and their executors, against ``topology.superlink_address``."""
        for node in nodes:
            self.start_service(f"supernode-{node}", supernode_command(self.topology, node))
            self.start_service(f"superexec-clientapp-{node}", clientapp_executor_command(self.topology, node))

    def wait_for_supernodes(self, count: int, timeout_s: float) -> None:
        """Until the SuperLink sees ``count`` SuperNodes online (an error naming a service that died first)."""
        everyone = self.running_and(lambda: online_supernodes(self.cli_environment) >= count)
        wait_until(everyone, timeout_s, f"{count} SuperNodes to be online", interval_s=2.0)

    def run(self, config: RunConfig) -> tuple[str, str]:
        """Submit one experiment, stream its log while watching the services (:meth:`watch`), return its final
        ``(status, details)``: ``aborted`` when the SuperLink exited."""
        return submit_and_follow(config, self.cli_environment, [CONNECTION], lambda: self.watch(config))

    def watch(self, config: RunConfig) -> str | None:
        """Report each service that exited since the last call; stop the other half of a node that lost one;
        when the SuperLink is gone, the reason the run cannot go on, with the command that resumes it."""
        self.report_exits()
        if "superlink" not in self.exited:
            return None
        advice = resume_advice(config, self.topology.num_supernodes, self.topology.certificates is not None,
                               self.topology.executor)
        reason = f"the SuperLink exited with {self.exited['superlink']}; {advice}"
        print(f"[alignfl] {reason}", file=sys.stderr, flush=True)
        return reason

    def report_exits(self) -> None:
        """Report each service that exited since the last call, and stop the other half of its node."""
        table = process_table()
        for name, tree in self.services.items():
            tree.refresh(table)
            if name not in self.exited and tree.process.poll() is not None:
                self.exited[name] = exit_description(tree.process.returncode)
                print(f"[alignfl] {name} exited with {self.exited[name]}; its log: {self.log_file(name)}",
                      file=sys.stderr, flush=True)
                self.stop_partner(name)

    def stop_partner(self, name: str) -> None:
        """A SuperNode without its executor never answers, and an executor without its SuperNode has nothing to
        run: stop the other half too, so the SuperLink drops the node and the run goes on without it."""
        partner = partner_of(name)
        if partner is None or partner not in self.services or partner in self.exited:
            return
        print(f"[alignfl] stopping {partner} too; the run goes on with the other SuperNodes (the SuperLink drops "
              "this one within about a minute)", file=sys.stderr, flush=True)
        stop_processes([self.services[partner]], grace_s=10.0)
        self.exited[partner] = f"stopped with {name}"

    def stop(self) -> None:
        """Stop every process this deployment started (by process id), all at once."""
        stop_processes(list(self.services.values()), grace_s=30.0)


@contextmanager
def deployment(topology: Topology, work: Path) -> Iterator[Deployment]:
    """A started deployment, stopped on leaving the block however it is left."""
    running = Deployment(topology, work)
    try:
        running.start()
        yield running
    finally:
        running.stop()


def make_certificates(folder: Path, num_supernodes: int, superlink_sans: str = "") -> Path:
    """``scripts/make_certs.sh`` into ``folder`` (existing files are kept); ``superlink_sans``: more names for
    the SuperLink's certificate (``IP:10.0.0.1,DNS:fl.example.org``)."""
    env = {**os.environ, "SUPERLINK_SANS": superlink_sans}
    subprocess.run(["bash", str(MAKE_CERTS), str(folder), str(num_supernodes)], check=True, stdout=subprocess.DEVNULL,
                   env=env)
    return folder


def check_folder(option: str, folder: Path) -> None:
    """Refuse a folder the deployment must write to but cannot, naming the option."""
    problem = path_problem(folder, writable=True)
    if problem is not None:
        raise ConfigError(f"{option} {str(folder)!r} is not allowed: it must be a folder this user can write to "
                          f"({problem})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["register"]:
        return register_main(argv[1:])
    if argv[:1] in (["superlink"], ["supernodes"]):
        from fl_app.roles import role_main

        return role_main(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fl_app.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-supernodes", type=int, default=COMPOSE_NUM_SUPERNODES,
                        help=f"SuperNodes, one partition each (default {COMPOSE_NUM_SUPERNODES}, as in the compose file)")
    parser.add_argument("--run-config", default="", help="'key=value ...' overrides of [tool.flwr.app.config]")
    parser.add_argument("--rounds", type=int, help="shorthand for the run-config key num-server-rounds")
    parser.add_argument("--tls", action="store_true",
                        help="TLS on every API and SuperNode authentication (keys registered before nodes start)")
    parser.add_argument("--certs", type=Path,
                        help="make_certs.sh's output folder for --tls (default: made afresh in the work folder)")
    parser.add_argument("--executor", choices=list(EXECUTORS), default=DEFAULT_EXECUTOR,
                        help="how each SuperNode starts its ClientApp processes: warm (forked from a process that "
                             "imported Flower, torch and the app's dependencies once) or flower (Flower's own: a "
                             f"fresh flwr-clientapp process per message); default {DEFAULT_EXECUTOR}")
    parser.add_argument("--work-dir", type=Path,
                        help="where the services' logs, Flower homes and state go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    config = None
    try:
        with stop_signals():
            try:
                config = prepare(args)
            except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
                print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
                return 2
            return deploy_and_run(config, args)
    except Stopped as stop:
        advice = f"; {resume_advice(config, args.num_supernodes, args.tls, args.executor)}" if config else ""
        print(f"[alignfl] stopped by {stop}: every process of the deployment has been stopped{advice}",
              file=sys.stderr)
        return stop.exit_code


def prepare(args: argparse.Namespace) -> RunConfig:
    """Check the options and the run config before anything starts."""
    if args.num_supernodes < 1:
        raise ValueError(f"--num-supernodes must be at least 1, got {args.num_supernodes}")
    if args.certs is not None and not args.tls:
        raise ValueError("--certs is only used with --tls")
    for option, folder in (("--work-dir", args.work_dir), ("--certs", args.certs)):
        if folder is not None:
            check_folder(option, folder.resolve())
    overrides = parse_overrides(args.run_config)
    if args.rounds is not None:
        overrides["num-server-rounds"] = args.rounds
    return prepare_config(overrides, args.num_supernodes)


def deploy_and_run(config: RunConfig, args: argparse.Namespace) -> int:
    """Start the deployment, run the experiment on it, stop everything; the exit code."""
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="alignfl-deploy-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    certs = None
    if args.tls:
        certs = make_certificates((args.certs or work / "certs").resolve(), args.num_supernodes)
    print(f"[alignfl] deployment on 127.0.0.1: {args.num_supernodes} SuperNodes, "
          f"{'TLS + SuperNode authentication' if args.tls else 'plaintext'}, {args.executor} ClientApp executor; "
          f"logs in {work / 'logs'}", flush=True)
    try:
        with deployment(loopback_topology(args.num_supernodes, work, certs, args.executor), work) as running:
            status, details = running.run(config)
    except (RuntimeError, TimeoutError) as error:
        print(f"[alignfl] deployment FAILED: {error}", file=sys.stderr)
        return 1
    code = report_outcome(config, status, details)
    if running.exited and status != "aborted":
        print("[alignfl] services that exited during the run: "
              + ", ".join(f"{name} ({how})" for name, how in running.exited.items())
              + f"; their logs are in {work / 'logs'}", file=sys.stderr)
    return code


def register_main(argv: list[str]) -> int:
    """``python -m fl_app.deploy register --superlink HOST:PORT --root-certificates CA KEY.pub ...``"""
    parser = argparse.ArgumentParser(prog="python -m fl_app.deploy register",
                                     description="Register SuperNode public keys with a SuperLink that authenticates "
                                                 "SuperNodes; waits for the SuperLink first.")
    parser.add_argument("--superlink", required=True, help="the SuperLink's address, host:port")
    parser.add_argument("--root-certificates", required=True, help="the CA certificate the SuperLink's is signed by")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the SuperLink")
    parser.add_argument("public_keys", nargs="+", help="SuperNode public keys (OpenSSH format, make_certs.sh's auth.pub)")
    args = parser.parse_args(argv)
    missing = [key for key in [args.root_certificates, *args.public_keys] if not Path(key).is_file()]
    if missing:
        print(f"[alignfl] no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="alignfl-register-"))
    try:
        write_connection(home, args.superlink, args.root_certificates)
        url = health_url(args.superlink, args.root_certificates)
        verify = trust(args.root_certificates)
        wait_until(lambda: healthy(url, verify), args.timeout, f"the SuperLink at {url}")
        register_supernodes(args.public_keys, flower_environment(home))
    except (RuntimeError, TimeoutError) as error:
        print(f"[alignfl] registration FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"[alignfl] registered {len(args.public_keys)} SuperNode key(s) with {args.superlink}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
