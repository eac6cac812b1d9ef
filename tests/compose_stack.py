"""The compose check's stacks and step records: what ``scripts/compose_check.sh``'s scenarios
(``tests/compose_scenarios.py``) run on.

A :class:`Stack` is one compose stack (its files, the environment they read, the flwr CLI's connection to its
SuperLink); a :class:`Recorder` runs steps and records each (result, seconds, name, note) as a tab-separated line
of ``WORK/steps.tsv``, which the script's report prints.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from alignfl.fl_app.runtime.flwr_cli import online_supernodes, write_connection
from alignfl.fl_app.runtime.processes import Stopped, log_tail
from alignfl.fl_app.runtime.superlink import flower_environment, health_url, healthy, trust, wait_until
from alignfl.fl_app.runtime.topology import COMPOSE_NUM_SUPERNODES, COMPOSE_SUPERLINK_PORT

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""

PROJECT = "alignfl"
"""docker-compose.yml's project name: every container, network and volume of the stacks carries its label."""
PLAIN = (PROJECT_ROOT / "docker-compose.yml",)
TLS = (*PLAIN, PROJECT_ROOT / "compose.tls.yml")
CONTAINER_UID = 49999
"""The image's user: it writes the run folders and reads the keys."""
NODES = COMPOSE_NUM_SUPERNODES
PORT = COMPOSE_SUPERLINK_PORT
STEP_GROUPS = ("kill", "loopback", "tls")


class StepFailed(Exception):
    """A step's check did not hold; the message is the report's note."""


class CheckEnded(Exception):
    """A critical step failed: the rest of the check cannot run."""


@dataclass(frozen=True)
class Settings:
    """The scenarios' parameters (the script's environment variables of the same names)."""

    work: Path
    rounds: int = 2
    seed: int = 0
    run_timeout_s: float = 1800.0
    """The longest a run may take: a run that hangs is stopped and fails its step."""
    kill_min_nodes: int = 2
    kill_rounds: int = 3
    """Round 2 samples the dead node before the SuperLink marks it offline, round 3 after."""
    compare_tol: float = 0.02
    """The largest accepted |compose - loopback| final accuracy."""
    skip: frozenset[str] = frozenset()


@dataclass
class Step:
    result: str
    seconds: int
    name: str
    note: str

    def line(self) -> str:
        """One line of ``steps.tsv`` (tabs and newlines in the note become spaces)."""
        note = " ".join(self.note.split())
        return f"{self.result}\t{self.seconds}\t{self.name}\t{note}\n"


@dataclass
class Recorder:
    """Runs steps, records each in ``steps.tsv`` as soon as it ends; a failed critical step ends the check."""

    path: Path
    steps: list[Step] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(step.result != "PASS" for step in self.steps)

    def record(self, step: Step) -> None:
        self.steps.append(step)
        with self.path.open("a") as stream:
            stream.write(step.line())
        print(f"[compose-check {time.strftime('%H:%M:%S')}] {step.result}: {step.name}: {step.note}", flush=True)

    def note(self, text: str) -> None:
        """A fact for the report's notes."""
        with self.path.open("a") as stream:
            stream.write(f"note\t0\t\t{' '.join(text.split())}\n")

    def step(self, name: str, action: Callable[[], str], critical: bool = False) -> None:
        """Run ``action`` (it returns the note, or raises :class:`StepFailed`); :class:`CheckEnded` after a failed
        critical step. A stop signal records the step as unfinished and goes on unwinding."""
        print(f"[compose-check {time.strftime('%H:%M:%S')}] == {name}", flush=True)
        start = time.monotonic()
        try:
            note, result = action(), "PASS"
        except StepFailed as failure:
            note, result = str(failure), "FAIL"
        except (Exception, subprocess.TimeoutExpired) as error:  # a command that failed or hung: the step fails
            note, result = f"{type(error).__name__}: {error}", "FAIL"
        except Stopped as stop:
            self.record(Step("FAIL", round(time.monotonic() - start), name, f"did not finish: stopped by {stop}"))
            raise
        self.record(Step(result, round(time.monotonic() - start), name, note))
        if result == "FAIL" and critical:
            raise CheckEnded(name)


# --- docker compose ---


@dataclass
class Stack:
    """One compose stack (its files), the environment its files read, and the flwr CLI's connection to it."""

    files: tuple[Path, ...]
    work: Path
    mode: str
    """``plain`` or ``tls``: names its logs and Flower home."""

    @property
    def certs(self) -> Path:
        return self.work / "certs"

    @property
    def ca(self) -> str | None:
        return str(self.certs / "ca.crt") if self.mode == "tls" else None

    def environment(self) -> dict[str, str]:
        """What the compose files read: results and data folders, keys, the published address (this host only)."""
        fashion = Path(os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
        if not fashion.is_dir():  # digits needs none; mount an empty one
            fashion = self.work / "no-fashion-mnist"
            fashion.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "ALIGNFL_RESULTS": str(self.work / "results"),
            "ALIGNFL_DATA": str(self.work / "data"),
            "ALIGNFL_CERTS": str(self.certs),
            "SUPERLINK_PUBLISH": f"127.0.0.1:{PORT}",
            "FASHION_MNIST_DIR": str(fashion),
        }

    def compose(self, *args: str, limit_s: float = 300.0, log: Path | None = None) -> subprocess.CompletedProcess:
        """``docker compose -f FILES... ARGS``; output captured, or written to ``log``."""
        command = [
            "docker",
            "compose",
            "--project-directory",
            str(PROJECT_ROOT),
            *(part for file in self.files for part in ("-f", str(file))),
            *args,
        ]
        if log is None:
            return subprocess.run(
                command,
                env=self.environment(),
                text=True,
                capture_output=True,
                timeout=limit_s,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        with log.open("w") as stream:
            return subprocess.run(
                command,
                env=self.environment(),
                text=True,
                stdout=stream,
                stderr=subprocess.STDOUT,
                timeout=limit_s,
                stdin=subprocess.DEVNULL,
                check=False,
            )

    @property
    def cli_environment(self) -> dict[str, str]:
        """The ``flwr`` CLI's environment, its connection to the stack's SuperLink on 127.0.0.1."""
        home = self.work / f"flwr-home-{self.mode}"
        write_connection(home, f"127.0.0.1:{PORT}", self.ca)
        return flower_environment(home)

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}-{self.mode}.log"

    def save_logs(self) -> Path:
        """Every service's log, for the record."""
        self.compose("logs", "--no-color", limit_s=120, log=self.log("compose"))
        return self.log("compose")

    def up(self) -> str:
        """Start the stack; wait for the SuperLink's health and every SuperNode online."""
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", PORT)) == 0:
                raise StepFailed(f"127.0.0.1:{PORT} is already in use")
        for folder in ("results", "data"):  # the containers' user writes there
            (self.work / folder).mkdir(parents=True, exist_ok=True)
            (self.work / folder).chmod(0o777)
        if self.compose("up", "-d", "--no-build", limit_s=600, log=self.log("up")).returncode != 0:
            raise StepFailed(
                f"compose up failed: {log_tail(self.log('up'), 5)}; services: {log_tail(self.save_logs(), 20)}"
            )
        url, verify, env = health_url(f"127.0.0.1:{PORT}", self.ca), trust(self.ca), self.cli_environment
        try:
            wait_until(lambda: healthy(url, verify), 180, f"the SuperLink's health endpoint {url}", interval_s=2.0)
            wait_until(lambda: online_supernodes(env) >= NODES, 300, f"{NODES} SuperNodes online", interval_s=2.0)
        except TimeoutError as error:
            raise StepFailed(f"{error}; services: {log_tail(self.save_logs(), 20)}") from None
        published = sorted(
            {
                mapping.strip()
                for mapping in docker("ps", "--filter", f"label={LABEL}", "--format", "{{.Ports}}")
                .replace("\n", ",")
                .split(",")
                if "->" in mapping
            }
        )
        containers = len(self.compose("ps", "-q").stdout.split())
        note = f"{containers} containers; {NODES} SuperNodes online; published: {' '.join(published)}"
        if any("0.0.0.0" in mapping or ":::" in mapping for mapping in published):
            raise StepFailed(f"{note}; a port is published beyond 127.0.0.1")
        return note

    def served_by_warm_processes(self) -> str:
        """What the SuperNodes' and executors' logs say: every SuperNode polling faster, every executor's warm
        parent ready, and how many ClientApp processes it forked ended well; a StepFailed where one did not."""
        services = [f"{kind}-{node}" for node in range(NODES) for kind in ("supernode", "superexec-clientapp")]
        logs = ANSI_ESCAPE.sub("", self.compose("logs", "--no-color", *services, limit_s=120).stdout)
        polling = sum(line.startswith("supernode-") and POLLING in line for line in logs.splitlines())
        parents = sum(line.startswith("superexec-clientapp-") and WARM_READY in line for line in logs.splitlines())
        children = len(WARM_ENDED.findall(logs))
        if polling < NODES or parents < NODES or not children:
            raise StepFailed(
                f"{polling} of {NODES} SuperNodes polling faster, {parents} warm parents ready, "
                f"{children} warm ClientApp processes ended with code 0"
            )
        return (
            f"{polling} SuperNodes asking every 0.5 s, {parents} warm ClientApp parents, {children} warm "
            "ClientApp processes ended with code 0"
        )

    def down(self) -> str:
        """``down -v``; nothing of the project may be left."""
        self.save_logs()
        if self.compose("down", "-v", "--remove-orphans", "--timeout", "20", log=self.log("down")).returncode:
            raise StepFailed(f"compose down failed: {log_tail(self.log('down'), 5)}")
        left = project_leftovers()
        if left:
            raise StepFailed(f"left after down -v: {' '.join(left)}")
        return f"no container, network or volume of project {PROJECT} left"


LABEL = f"com.docker.compose.project={PROJECT}"
POLLING = "[alignfl] the SuperNode asks for a message every"
WARM_READY = "[alignfl] warm ClientApp parent pid"
WARM_ENDED = re.compile(r"ClientApp process pid \d+ ended with code 0")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""Terminal control sequences that ``docker compose logs`` writes even with ``--no-color`` (erase line, and the
colours of Flower's log levels)."""


def docker(*args: str) -> str:
    """``docker ARGS``'s output (empty when it fails)."""
    done = subprocess.run(
        ["docker", *args], text=True, capture_output=True, timeout=120, check=False, stdin=subprocess.DEVNULL
    )
    return done.stdout if done.returncode == 0 else ""


def project_leftovers() -> list[str]:
    """Every container, network and volume of the project still there."""
    return [
        f"{kind}:{name}"
        for kind, listing in (
            ("container", ("ps", "-aq")),
            ("network", ("network", "ls", "-q")),
            ("volume", ("volume", "ls", "-q")),
        )
        for name in docker(*listing, "--filter", f"label={LABEL}").split()
    ]
