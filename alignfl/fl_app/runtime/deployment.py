"""The loopback deployment while it runs: docker-compose.yml's services as local processes on 127.0.0.1
(:func:`alignfl.fl_app.runtime.topology.loopback_topology`), started in the compose file's order, watched while a run
goes on, and stopped by process id however the block that holds them is left.

While the run goes on it watches the services: one that exits is reported at once
(name, exit code, log file). A SuperNode and its executor go down together (one
without the other cannot answer), and the run goes on with the other nodes. When
the SuperLink exits the run cannot go on: the watch gives up with the command
that continues the run from its checkpoint (``resume-from``).

A SuperNode that dies is noticed through its heartbeats: Flower's SuperNode (1.41, 1.42)
sends one every 30 s and the SuperLink marks it offline after two missed
(``HEARTBEAT_DEFAULT_INTERVAL`` × ``HEARTBEAT_PATIENCE``, not configurable), and
then answers the messages sent to it with an error reply, so a round that
sampled a dead node goes on without it at most about a minute later; later rounds
sample only the nodes online (round 1 waits for ``min-available-nodes``, at most
``node-wait-timeout`` seconds).

    with deployment(loopback_topology(3, work), work) as running:
        status, details = running.run(config)
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, count
from pathlib import Path

from alignfl.fl_app.checkpoint import checkpointed_round, run_folder
from alignfl.fl_app.config import RunConfig, default_run_config
from alignfl.fl_app.locations import checkout_root
from alignfl.fl_app.patches.polling_supernode import DEFAULT_NODE_POLL_S
from alignfl.fl_app.runtime.flwr_cli import (
    CONNECTION,
    online_supernodes,
    register_supernodes,
    submit_and_follow,
    to_toml_pairs,
    write_connection,
)
from alignfl.fl_app.runtime.processes import (
    ProcessTree,
    exit_description,
    log_tail,
    process_table,
    start_process,
    stop_processes,
)
from alignfl.fl_app.runtime.superlink import flower_environment, health_url, healthy, trust, wait_until
from alignfl.fl_app.runtime.topology import (
    DEFAULT_EXECUTOR,
    Topology,
    clientapp_executor_command,
    node_poll_option,
    serverapp_executor_command,
    superlink_command,
    supernode_command,
)

STARTUP_TIMEOUT_S = 240.0


def partner_of(service: str) -> str | None:
    """The other half of a node: ``supernode-<i>`` and ``superexec-clientapp-<i>``."""
    for one, other in (("supernode-", "superexec-clientapp-"), ("superexec-clientapp-", "supernode-")):
        if service.startswith(one):
            return other + service.removeprefix(one)
    return None


def deploy_command() -> list[str]:
    """The command that starts a deployment: the checkout's ``scripts/deploy.sh`` (which sets the checkout up
    first), else the installed console script's ``alignfl deploy``."""
    root = checkout_root()
    return [str(root / "scripts" / "deploy.sh")] if root is not None else ["alignfl", "deploy"]


def resume_command(
    config: RunConfig,
    num_supernodes: int,
    tls: bool,
    executor: str = DEFAULT_EXECUTOR,
    node_poll_s: float | None = DEFAULT_NODE_POLL_S,
) -> str:
    """The command (:func:`deploy_command`) that continues ``config``'s run from its checkpoint on a new
    deployment of the same shape (with TLS, on keys made afresh): the run's keys that differ from their defaults,
    and ``resume-from`` its folder."""
    defaults = default_run_config()
    values = {
        key: value
        for key, value in config.to_run_config().items()
        if key not in ("run-name", "resume-from") and value != defaults.get(key)
    }
    values["resume-from"] = str(run_folder(config))
    command = [*deploy_command(), "--num-supernodes", str(num_supernodes)]
    options = [
        *(["--tls"] if tls else []),
        *(["--executor", executor] if executor != DEFAULT_EXECUTOR else []),
        *(["--node-poll", node_poll_option(node_poll_s)] if node_poll_s != DEFAULT_NODE_POLL_S else []),
    ]
    return shlex.join([*command, *options, "--run-config", to_toml_pairs(values)])


def resume_advice(
    config: RunConfig,
    num_supernodes: int,
    tls: bool,
    executor: str = DEFAULT_EXECUTOR,
    node_poll_s: float | None = DEFAULT_NODE_POLL_S,
) -> str:
    """How to continue a run that stopped early, from its last checkpoint."""
    done = checkpointed_round(config)
    if done is None:
        return "the run checkpointed no round, so it must start again"
    return (
        f"rounds up to {done} are checkpointed in {run_folder(config)}; continue the run with:\n  "
        f"{resume_command(config, num_supernodes, tls, executor, node_poll_s)}"
    )


@dataclass
class Deployment:
    """The loopback deployment's processes, started in the compose file's order, each with every process it
    starts (its executor's app processes), so stopping one stops what it started. Each service's Flower home is
    under ``work`` (their working folder too), its log in ``logs`` (default ``work/logs``)."""

    topology: Topology
    work: Path
    logs: Path | None = None
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
        return (self.logs or self.work / "logs") / f"{name}.log"

    def start_service(self, name: str, command: list[str]) -> ProcessTree:
        self.log_file(name).parent.mkdir(parents=True, exist_ok=True)
        with self.log_file(name).open("wb") as log_file:
            tree = start_process(command, self.environment(name), self.work, stdout=log_file, stderr=subprocess.STDOUT)
        self.services[name] = tree
        return tree

    def log_tail(self, name: str, lines: int = 15) -> str:
        return log_tail(self.log_file(name), lines)

    def running_and(self, condition: Callable[[], bool]) -> Callable[[], bool]:
        """``condition`` for :func:`wait_until`, but first an error with the log of a service that died."""

        def check() -> bool:
            for name, tree in self.services.items():
                if tree.process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {exit_description(tree.process.returncode)}; the end "
                        f"of its log ({self.log_file(name)}):\n{self.log_tail(name)}"
                    )
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
        wait_until(  # a cheap HTTP request: asked as often as local_superlink asks
            self.running_and(lambda: healthy(url, verify)), timeout_s, f"the SuperLink at {url}", interval_s=0.25
        )
        self.start_service("superexec-serverapp", serverapp_executor_command(topology))
        if topology.certificates is not None:
            register_supernodes(
                [topology.certificates.auth_public_key(node) for node in range(topology.num_supernodes)],
                self.cli_environment,
            )

    def start_supernodes(self, nodes: Iterable[int]) -> None:
        """These SuperNodes and their executors, against ``topology.superlink_address``."""
        for node in nodes:
            self.start_service(f"supernode-{node}", supernode_command(self.topology, node))
            self.start_service(f"superexec-clientapp-{node}", clientapp_executor_command(self.topology, node))

    def restart_node(self, node: int) -> None:
        """SuperNode ``node`` and its executor started again (what is left of them stopped first), how they ended
        forgotten."""
        names = [f"supernode-{node}", f"superexec-clientapp-{node}"]
        stop_processes([self.services[name] for name in names if name in self.services], grace_s=10.0)
        for name in names:
            self.exited.pop(name, None)
        self.start_supernodes([node])

    def wait_for_supernodes(self, count: int, timeout_s: float) -> None:
        """Until the SuperLink sees ``count`` SuperNodes online (an error naming a service that died first)."""
        everyone = self.running_and(lambda: online_supernodes(self.cli_environment) >= count)
        wait_until(everyone, timeout_s, f"{count} SuperNodes to be online", interval_s=2.0)

    def run(self, config: RunConfig) -> tuple[str, str]:
        """Submit one experiment, stream its log while watching the services (:meth:`watch`), return its final
        ``(status, details)``: ``aborted`` when the SuperLink exited."""
        return submit_and_follow(config.to_run_config(), self.cli_environment, [CONNECTION], lambda: self.watch(config))

    def watch(self, config: RunConfig) -> str | None:
        """Report each service that exited since the last call; stop the other half of a node that lost one;
        when the SuperLink is gone, the reason the run cannot go on, with the command that resumes it."""
        self.report_exits()
        if "superlink" not in self.exited:
            return None
        advice = resume_advice(
            config,
            self.topology.num_supernodes,
            self.topology.certificates is not None,
            self.topology.executor,
            self.topology.node_poll_s,
        )
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
                print(
                    f"[alignfl] {name} exited with {self.exited[name]}; its log: {self.log_file(name)}",
                    file=sys.stderr,
                    flush=True,
                )
                self.stop_partner(name)

    def stop_partner(self, name: str) -> None:
        """A SuperNode without its executor never answers, and an executor without its SuperNode has nothing to
        run: stop the other half too, so the SuperLink drops the node and the run goes on without it."""
        partner = partner_of(name)
        if partner is None or partner not in self.services or partner in self.exited:
            return
        print(
            f"[alignfl] stopping {partner} too; the run goes on with the other SuperNodes (the SuperLink drops "
            "this one within about a minute)",
            file=sys.stderr,
            flush=True,
        )
        stop_processes([self.services[partner]], grace_s=10.0)
        self.exited[partner] = f"stopped with {name}"

    def stop(self) -> None:
        """Stop every process this deployment started (by process id), all at once."""
        stop_processes(list(self.services.values()), grace_s=30.0)


def run_logs(config: RunConfig) -> Path:
    """Where a deployment that runs ``config`` keeps its services' logs when no ``--work-dir`` is given: beside the
    run's results, in ``logs`` of its run folder, or ``logs-2``, ``logs-3``, ... when an earlier deployment of the
    same folder (one the run resumes) left logs there."""
    folders = (run_folder(config) / name for name in chain(["logs"], (f"logs-{n}" for n in count(2))))
    return next(logs for logs in folders if not logs.exists() or (logs.is_dir() and not any(logs.iterdir())))


@contextmanager
def deployment(topology: Topology, work: Path, logs: Path | None = None) -> Iterator[Deployment]:
    """A started deployment, stopped on leaving the block however it is left."""
    running = Deployment(topology, work, logs)
    try:
        running.start()
        yield running
    finally:
        running.stop()
