"""Run the app with ``flwr run`` on a private local SuperLink and exit with the run's real outcome.

``flwr run --stream`` exits 0 even when the run failed, a detached SuperLink keeps
the environment of whoever started it, and the app runs from a copy in another
directory. This launcher therefore validates the run config first, starts its
own SuperLink (own Flower home, free ports, the settings the app needs), submits
the run, streams its log, reads the final status, checks the run folder, and
stops the SuperLink it started by process id, with every process it started in
turn (its SuperExec, ``flwr-simulation``, Ray), also on SIGTERM, SIGINT (Ctrl-C)
or SIGHUP, after which it exits with 128 + the signal's number.

    python -m fl_app.launch --num-supernodes 10 --run-config "num-server-rounds=5 dirichlet-alpha=0.1"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from fl_app.checkpoint import CHECKPOINT, load_checkpoint, resume_checkpoint
from fl_app.config import ConfigError, RunConfig, parse_run_config, results_root, validate_run
from core.data import DatasetMissingError, check_dataset_available
from core.partitioning.partitions import partition_dataset

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATUS_TIMEOUT_S = 120.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WATCH_INTERVAL_S = 0.5

Watch = Callable[[], "str | None"]
"""Called about twice a second while a run goes on: reports what it sees, and returns why the run cannot go on
(None: it can)."""


def parse_overrides(text: str) -> dict[str, Any]:
    """``'k=v k2="s"'`` as ``flwr run --run-config`` reads it (TOML values), into a dict."""
    overrides: dict[str, Any] = {}
    for item in _split_pairs(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"run-config override {item!r} is not of the form key=value")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError as error:
            if '"' in value or "'" in value:  # a broken string, never a bare word
                raise ConfigError(f"run-config override {item!r}: {value.strip()!r} is not a TOML value ({error}); "
                                  'write strings in double quotes, e.g. run-name="abc"') from None
            overrides[key.strip()] = value.strip()
    return overrides


def _split_pairs(text: str) -> list[str]:
    """Split on spaces outside double quotes; an unclosed quote is a syntax error."""
    pairs, current, quoted = [], "", False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == " " and not quoted:
            if current:
                pairs.append(current)
            current = ""
        else:
            current += char
    if quoted:
        raise ConfigError(f"--run-config {text!r}: a double quote is not closed (in {current!r})")
    return pairs + ([current] if current else [])


def to_toml_pairs(values: dict[str, Any]) -> str:
    """The inverse of :func:`parse_overrides` for ``flwr run --run-config``."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SUPEREXEC_POLL_S = "0.1"
"""Seconds between a SuperExec's checks for new work (Flower's default 1 s idles every message 0.5 s on average;
also set in the Dockerfile)."""


def flower_environment(flwr_home: Path) -> dict[str, str]:
    """Environment for a private local SuperLink and the ``flwr`` commands that talk to it."""
    env = dict(os.environ)
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": SUPEREXEC_POLL_S,
        "RAY_DEDUP_LOGS": "0",
    })
    return env


# --- stopping what was started ----------------------------------------------------------------------------


class Stopped(BaseException):
    """A stop signal arrived. Like KeyboardInterrupt it unwinds through every ``finally`` that stops
    processes, and no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _StopSignals:
    """Raises :class:`Stopped` for the first stop signal only; one that comes while processes are being
    stopped waits until they are, so a second Ctrl-C never leaves half of them running."""

    def __init__(self) -> None:
        self.raised = False
        self.pending: int | None = None
        self.holding = 0

    def handle(self, signum: int, _frame: object) -> None:
        if self.raised:
            return
        if self.holding:
            self.pending = signum
            return
        self.raised = True
        raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        if not self.holding and self.pending is not None and not self.raised:
            self.raised = True
            raise Stopped(self.pending)


_SIGNALS = _StopSignals()


@contextmanager
def stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Stopped` in the main thread; the handlers
    before are restored after it."""
    global _SIGNALS
    _SIGNALS = _StopSignals()
    previous = {signum: signal.signal(signum, _SIGNALS.handle) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True)
class ProcessStat:
    """What /proc/<pid>/stat says of a process that finding and stopping process trees needs."""

    ppid: int
    pgid: int
    sid: int
    start: int
    """Clock ticks after boot: with the pid, it names one process (pids are reused)."""
    zombie: bool


def _stat(pid: int) -> ProcessStat | None:
    """A process's entry in /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            fields = stream.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except OSError:
        return None
    return ProcessStat(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0] == "Z")


def process_table() -> dict[int, ProcessStat]:
    """Every process on this machine."""
    stats = {int(entry.name): _stat(int(entry.name)) for entry in os.scandir("/proc") if entry.name.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat is not None}


@dataclass
class ProcessTree:
    """A started process and every process started from it, found by process id even after their parent died
    (Flower's SuperExec runs in a session of its own, Ray's daemons outlive their parent there): each
    :meth:`refresh` remembers the members by pid and start time, and the sessions and groups they lead."""

    process: subprocess.Popen
    members: dict[int, int] = field(default_factory=dict)
    """pid → start time of every process seen in the tree."""
    leaders: set[int] = field(default_factory=set)
    """Sessions and process groups led by a member (never this process's own)."""

    def refresh(self, table: dict[int, ProcessStat] | None = None) -> dict[int, int]:
        """The tree's live processes now (pid → start time); remembers them."""
        table = table if table is not None else process_table()
        own = {os.getpid(), os.getsid(0), os.getpgrp()}
        found = {pid for pid, start in self.members.items() if pid in table and table[pid].start == start}
        self.leaders = {leader for leader in self.leaders if any(
            table[pid].sid == leader or table[pid].pgid == leader for pid in found)}
        if self.process.poll() is None and self.process.pid in table:
            found.add(self.process.pid)
        while True:
            self.leaders |= {pid for pid in found if pid not in own and pid in (table[pid].sid, table[pid].pgid)}
            grown = found | {pid for pid, stat in table.items() if pid not in own and (
                stat.ppid in found or stat.sid in self.leaders or stat.pgid in self.leaders)}
            if grown == found:
                break
            found = grown
        live = {pid: table[pid].start for pid in found if not table[pid].zombie}
        self.members.update(live)
        return live


def stop_processes(trees: Sequence[ProcessTree], grace_s: float = 20.0) -> None:
    """Stop every process of these trees: SIGTERM to all at once, SIGKILL to what is left after ``grace_s``.
    A stop signal that comes meanwhile waits until this is done."""
    with _SIGNALS.held():
        signalled: set[tuple[int, int]] = set()
        deadline = time.monotonic() + grace_s
        while True:
            for tree in trees:
                tree.process.poll()  # reaps it once it exits
            table = process_table()
            live = {(pid, start) for tree in trees for pid, start in tree.refresh(table).items()}
            if not live:
                break
            final = time.monotonic() > deadline
            for pid, start in live - (set() if final else signalled):
                _signal(pid, start, signal.SIGKILL if final else signal.SIGTERM)
            signalled |= live
            time.sleep(0.2)
        for tree in trees:
            tree.process.wait()


def _signal(pid: int, start: int, signum: int) -> None:
    """Signal one process, unless its pid now names another one."""
    stat = _stat(pid)
    if stat is not None and stat.start == start:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def start_process(command: list[str], env: dict[str, str], cwd: Path, **streams: Any) -> ProcessTree:
    """Start ``command`` in a session of its own (a Ctrl-C in the terminal reaches only this program, which
    stops it), as a :class:`ProcessTree`."""
    return ProcessTree(subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                        start_new_session=True, **streams))


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


def exit_description(code: int) -> str:
    """``code 3``, or ``signal SIGKILL`` for a process a signal ended (Popen's negative return codes)."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


# --- the local SuperLink ----------------------------------------------------------------------------------


@contextmanager
def local_superlink(env: dict[str, str], startup_timeout_s: float = 60.0) -> Iterator[Watch]:
    """Start ``flower-superlink`` in simulation mode (the flags ``flwr`` itself uses); yields a :data:`Watch`
    that gives up when the SuperLink exits. Everything it started is stopped after, by process id."""
    home = Path(env["FLWR_HOME"])
    (home / "local-superlink").mkdir(parents=True, exist_ok=True)
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    log_file = home / "local-superlink" / "superlink.log"
    command = [
        "flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
        "--control-api-address", f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}",
        "--host", "127.0.0.1", "--port", port,
        "--log-file", str(log_file),
        "--database", str(home / "local-superlink" / "state.db"),
    ]
    tree = start_process(command, env, PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def watch() -> str | None:
        tree.refresh()
        if tree.process.poll() is None:
            return None
        return (f"flower-superlink exited with {exit_description(tree.process.returncode)}; the end of its "
                f"log:\n{log_tail(log_file)}")

    try:
        deadline = time.monotonic() + startup_timeout_s
        while not healthy(f"http://127.0.0.1:{port}/health"):
            if tree.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flower-superlink did not start; the end of its log:\n{log_tail(log_file)}")
            time.sleep(0.25)
        yield watch
    finally:
        stop_processes([tree])


def healthy(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Whether a Flower HTTP API answers its health endpoint ``url`` (``verify``: how to trust its TLS)."""
    try:
        return httpx.get(url, timeout=1.0, verify=verify).is_success
    except httpx.HTTPError:
        return False


def flwr_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``flwr ARGS`` from the project root (``flwr run .`` builds the app from there), its output captured."""
    return subprocess.run(["flwr", *args], env=env, cwd=PROJECT_ROOT, text=True, capture_output=True, check=False,
                          stdin=subprocess.DEVNULL, start_new_session=True)


def never_give_up() -> str | None:
    """The :data:`Watch` of a run that only its own end ends."""
    return None


def run_status(run_id: str, env: dict[str, str], watch: Watch = never_give_up) -> tuple[str, str]:
    """``(status, details)`` of a run, waiting until it is finished (the status may lag the log); ``aborted``
    with watch's reason when it gives up first."""
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    while True:
        reason = watch()
        if reason is not None:
            return "aborted", reason
        listing = flwr_cli(["ls", "--run-id", run_id, "--format", "json"], env)
        try:
            run = json.loads(listing.stdout)["runs"][0]
            status, details = run["status"], run.get("status-details", "")
        except (json.JSONDecodeError, KeyError, IndexError):
            status, details = "unknown", listing.stdout + listing.stderr
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def follow_log(run_id: str, env: dict[str, str], watch: Watch) -> str | None:
    """Stream the run's log to this terminal until it ends; returns watch's reason if it gave up first."""
    stream = start_process(["flwr", "log", run_id, "--stream"], env, PROJECT_ROOT)
    try:
        while stream.process.poll() is None:
            reason = watch()
            if reason is not None:
                return reason
            time.sleep(WATCH_INTERVAL_S)
        return None
    finally:
        stop_processes([stream], grace_s=5.0)


def submit_and_follow(config: RunConfig, env: dict[str, str], run_args: list[str],
                      watch: Watch = never_give_up) -> tuple[str, str]:
    """Submit the run with ``flwr run PROJECT RUN_ARGS`` (a SuperLink connection name, federation
    settings), stream its log to this terminal, and return its final status (``aborted`` with the reason when
    ``watch`` gives up on it)."""
    submitted = flwr_cli(["run", str(PROJECT_ROOT), *run_args, "--format", "json", "--run-config",
                          to_toml_pairs(config.to_run_config())], env)
    try:
        reply = json.loads(submitted.stdout)
    except json.JSONDecodeError:
        reply = {}
    if not reply.get("success"):
        return "not-submitted", (submitted.stdout + submitted.stderr).strip()
    run_id = str(reply["run-id"])
    print(f"[alignfl] run {run_id} submitted", flush=True)
    reason = follow_log(run_id, env, watch)
    if reason is not None:
        return "aborted", reason
    return run_status(run_id, env, watch)


def prepare_config(overrides: dict[str, Any], num_supernodes: int) -> RunConfig:
    """Validate before anything starts; give the run an absolute results folder and a known name.

    Unless set, ``min-available-nodes`` is every simulated node, so each round samples from all of them.
    """
    defaults = {"results-dir": str(PROJECT_ROOT / "results"), "min-available-nodes": num_supernodes}
    config = parse_run_config({**defaults, **overrides})
    if not config.run_name:
        config = config.replace(run_name=f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}_{config.strategy}_"
                                         f"{config.model}_{config.dataset}_seed{config.seed}")
    if config.min_available_nodes > num_supernodes:
        raise ConfigError(f"run-config key 'min-available-nodes' = {config.min_available_nodes} exceeds "
                          f"--num-supernodes={num_supernodes}: the run would wait forever")
    validate_run(config)  # folders first: an unusable results-dir or data-root is named as such
    check_dataset_available(config.dataset, config.data_root or None)
    if config.resume_from:
        resume_checkpoint(config)  # a missing checkpoint or a changed key is refused here, not after submission
    partition_dataset(config.dataset, config.data_root or None, config.partitioner, num_supernodes, config.seed,
                      **config.partition_options())  # an infeasible split fails here, not in every client
    return config


def torch_cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported here only: the launcher starts in a second)."""
    import torch

    return torch.cuda.is_available()


def check_client_resources(num_cpus: int, num_gpus: float, cuda_available: bool) -> None:
    """Refuse client resources that Ray cannot schedule, before a SuperLink starts: Flower only finds out
    inside the run (an empty actor pool), after ``flwr run`` has already reported the submission."""
    if num_cpus < 1:
        raise ConfigError(f"--num-cpus={num_cpus} is not allowed: CPU cores per client must be an integer >= 1")
    if not num_gpus >= 0:
        raise ConfigError(f"--num-gpus={num_gpus} is not allowed: GPUs per client must be >= 0 "
                          "(a fraction such as 0.25 puts four clients on one GPU)")
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise ConfigError(f"--num-gpus={num_gpus} is not allowed: above 1, Ray hands out whole GPUs only")
    if num_gpus > 0 and not cuda_available:
        raise ConfigError(f"--num-gpus={num_gpus} but torch sees no CUDA device here, so no client could be "
                          "scheduled; use --num-gpus 0 (clients then train on CPU)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_app.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", default="", help="'key=value ...' overrides of [tool.flwr.app.config]")
    parser.add_argument("--num-supernodes", type=int, default=10, help="number of simulated clients (default 10)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPU cores reserved per simulated client")
    parser.add_argument("--num-gpus", type=float, default=0.0,
                        help="GPUs per simulated client; fractions share one GPU (e.g. 0.25 = 4 clients per GPU)")
    args = parser.parse_args(argv)
    config = None
    try:
        with stop_signals():
            try:
                check_client_resources(args.num_cpus, args.num_gpus, torch_cuda_available())
                config = prepare_config(parse_overrides(args.run_config), args.num_supernodes)
            except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
                print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
                return 2
            status, details = run_on_local_superlink(config, args)
    except Stopped as stop:
        print(f"[alignfl] stopped by {stop}: every process the launcher started has been stopped."
              f"{resume_hint(config)}", file=sys.stderr)
        return stop.exit_code
    except RuntimeError as error:  # the SuperLink did not start
        print(f"[alignfl] FAILED: {error}", file=sys.stderr)
        return 1
    return report_outcome(config, status, details)


def run_on_local_superlink(config: RunConfig, args: argparse.Namespace) -> tuple[str, str]:
    """Start a private SuperLink, run the experiment on it, stop everything; the run's final status."""
    federation = (f"num-supernodes={args.num_supernodes} client-resources-num-cpus={args.num_cpus} "
                  f"client-resources-num-gpus={args.num_gpus}")
    flwr_home = Path(tempfile.mkdtemp(prefix="alignfl-flwr-home-"))
    env = flower_environment(flwr_home)
    try:
        with local_superlink(env) as watch:
            return submit_and_follow(config, env, ["--federation-config", federation], watch)
    finally:
        shutil.rmtree(flwr_home, ignore_errors=True)


def run_folder(config: RunConfig) -> Path:
    """The run's folder: the one it resumes, or ``results-dir/run-name``."""
    return Path(config.resume_from) if config.resume_from else results_root(config) / config.run_name


def checkpointed_round(config: RunConfig) -> int | None:
    """The last round the run checkpointed, or None (no checkpoint, or not readable)."""
    if not (run_folder(config) / CHECKPOINT).is_file():
        return None
    try:
        return load_checkpoint(run_folder(config)).round
    except ConfigError:
        return None


def resume_hint(config: RunConfig | None) -> str:
    """How to continue a stopped run, if it checkpointed a round."""
    done = checkpointed_round(config) if config is not None else None
    if done is None:
        return ""
    return (f" Rounds up to {done} are checkpointed; add resume-from=\"{run_folder(config)}\" to --run-config to "
            "continue the run.")


def report_outcome(config: RunConfig, status: str, details: str) -> int:
    """Print the run's outcome and where its results are; the exit code: 0 only for a completed run
    whose summary was written."""
    folder = run_folder(config)
    summary = folder / "summary.json"
    if status != "finished:completed" or not summary.exists():
        print(f"[alignfl] run FAILED ({status}): {details}", file=sys.stderr)
        return 1
    result = json.loads(summary.read_text())
    print(f"[alignfl] run completed: final accuracy {result['final-accuracy']:.4f} "
          f"(best {result['best-accuracy']:.4f}); results in {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
