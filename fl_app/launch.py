"""Run the app with ``flwr run`` on a private local SuperLink and exit with the run's real outcome.

``flwr run --stream`` exits 0 even when the run failed, a detached SuperLink keeps
the environment of whoever started it, and the app runs from a copy in another
directory. This launcher therefore validates the run config first, starts its
own SuperLink (own Flower home, free ports, the settings the app needs), submits
the run, streams its log, reads the final status, checks the run folder, and
stops the SuperLink it started by process id.

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
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from fl_app.checkpoint import resume_checkpoint
from fl_app.config import ConfigError, RunConfig, parse_run_config, results_root, validate_run
from core.data import DatasetMissingError, check_dataset_available, partition_dataset

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATUS_TIMEOUT_S = 120.0


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
        "RAY_DEDUP_LOGS": "0",
    })
    return env


@contextmanager
def local_superlink(env: dict[str, str], startup_timeout_s: float = 60.0) -> Iterator[None]:
    """Start ``flower-superlink`` in simulation mode (the flags ``flwr`` itself uses), stop it by pid after."""
    home = Path(env["FLWR_HOME"])
    (home / "local-superlink").mkdir(parents=True, exist_ok=True)
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    command = [
        "flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
        "--control-api-address", f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}",
        "--host", "127.0.0.1", "--port", port,
        "--log-file", str(home / "local-superlink" / "superlink.log"),
        "--database", str(home / "local-superlink" / "state.db"),
    ]
    process = subprocess.Popen(command, env=env, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not healthy(f"http://127.0.0.1:{port}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flower-superlink did not start; see {home / 'local-superlink' / 'superlink.log'}")
            time.sleep(0.25)
        yield
    finally:
        stop_process_groups([process])


def healthy(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Whether a Flower HTTP API answers its health endpoint ``url`` (``verify``: how to trust its TLS)."""
    try:
        return httpx.get(url, timeout=1.0, verify=verify).is_success
    except httpx.HTTPError:
        return False


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """Terminate the process groups these processes lead (started with ``start_new_session``; they own
    their children, e.g. simulation or app processes), all at once; kill what is left after ``grace_s``.
    A process already reaped is skipped, so no group id that could have been reused is signalled."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:  # the whole group has exited meanwhile
        pass


def flwr_cli(args: list[str], env: dict[str, str], capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``flwr ARGS`` from the project root (``flwr run .`` builds the app from there)."""
    return subprocess.run(["flwr", *args], env=env, cwd=PROJECT_ROOT, text=True,
                          capture_output=capture, check=False)


def run_status(run_id: str, env: dict[str, str]) -> tuple[str, str]:
    """``(status, details)`` of a run, waiting until it is finished (the status may lag the log)."""
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    while True:
        listing = flwr_cli(["ls", "--run-id", run_id, "--format", "json"], env)
        try:
            run = json.loads(listing.stdout)["runs"][0]
            status, details = run["status"], run.get("status-details", "")
        except (json.JSONDecodeError, KeyError, IndexError):
            status, details = "unknown", listing.stdout + listing.stderr
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(1.0)


def submit_and_follow(config: RunConfig, env: dict[str, str], run_args: list[str]) -> tuple[str, str]:
    """Submit the run with ``flwr run PROJECT RUN_ARGS`` (a SuperLink connection name, federation
    settings), stream its log to this terminal, and return its final status."""
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
    flwr_cli(["log", run_id, "--stream"], env, capture=False)
    return run_status(run_id, env)


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
    check_dataset_available(config.dataset, config.data_root or None)
    validate_run(config)
    if config.resume_from:
        resume_checkpoint(config)  # a missing checkpoint or a changed key is refused here, not after submission
    partition_dataset(config.dataset, config.data_root or None, config.partitioner, num_supernodes, config.seed,
                      dirichlet_alpha=config.dirichlet_alpha, classes_per_client=config.classes_per_client,
                      shards_per_client=config.shards_per_client)  # an infeasible split fails here, not in every client
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
    try:
        check_client_resources(args.num_cpus, args.num_gpus, torch_cuda_available())
        config = prepare_config(parse_overrides(args.run_config), args.num_supernodes)
    except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
        print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
        return 2
    federation = (f"num-supernodes={args.num_supernodes} client-resources-num-cpus={args.num_cpus} "
                  f"client-resources-num-gpus={args.num_gpus}")
    flwr_home = Path(tempfile.mkdtemp(prefix="alignfl-flwr-home-"))
    env = flower_environment(flwr_home)
    try:
        with local_superlink(env):
            status, details = submit_and_follow(config, env, ["--federation-config", federation])
    finally:
        shutil.rmtree(flwr_home, ignore_errors=True)
    return report_outcome(config, status, details)


def report_outcome(config: RunConfig, status: str, details: str) -> int:
    """Print the run's outcome and where its results are; the exit code: 0 only for a completed run
    whose summary was written."""
    folder = Path(config.resume_from) if config.resume_from else results_root(config) / config.run_name
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
