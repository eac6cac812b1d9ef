"""A SuperLink: the environment of Flower's commands, free loopback ports, its health endpoint, and a private
local one in simulation mode.

A detached SuperLink keeps the environment of whoever started it, so each one here gets its own Flower home
(:func:`flower_environment`), and :func:`local_superlink` stops the one it started, with everything that started
from it, by process id.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from alignfl.fl_app.locations import process_folder
from alignfl.fl_app.provenance import COMMIT_ENV, git_commit
from alignfl.fl_app.runtime.common import free_port
from alignfl.fl_app.runtime.flwr_cli import Watch
from alignfl.fl_app.runtime.processes import exit_description, log_tail, start_process, stop_processes

SUPEREXEC_POLL_S = "0.1"
"""Seconds between a SuperExec's checks for new work (Flower's default 1 s idles every message 0.5 s on average;
also set in the Dockerfile)."""


def flower_environment(flwr_home: Path) -> dict[str, str]:
    """Environment for a private local SuperLink and the ``flwr`` commands that talk to it."""
    env = dict(os.environ)
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "FLWR_HOME": str(flwr_home),
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": SUPEREXEC_POLL_S,
            COMMIT_ENV: git_commit(),  # the ServerApp runs from an installed FAB, outside this checkout
            "RAY_DEDUP_LOGS": "0",
        }
    )
    return env


def health_url(address: str, root_certificates: str | None) -> str:
    """The health endpoint of the SuperLink at ``address`` (HTTPS when it has TLS)."""
    return f"{'https' if root_certificates else 'http'}://{address}/health"


def trust(root_certificates: str | None) -> ssl.SSLContext | bool:
    """How an HTTP client verifies the deployment's servers: by its CA (or the system's store)."""
    return ssl.create_default_context(cafile=root_certificates) if root_certificates else True


def healthy(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Whether a Flower HTTP API answers its health endpoint ``url`` (``verify``: how to trust its TLS)."""
    try:
        return httpx.get(url, timeout=1.0, verify=verify).is_success
    except httpx.HTTPError:
        return False


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 1.0) -> None:
    """Poll ``condition`` (a SuperLink's health, its SuperNodes online) until it holds; a :class:`TimeoutError`
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@contextmanager
def local_superlink(env: dict[str, str], startup_timeout_s: float = 60.0) -> Iterator[Watch]:
    """Start ``flower-superlink`` in simulation mode (the flags ``flwr`` itself uses) with ``env`` from
    :func:`flower_environment`; yields a :data:`~alignfl.fl_app.runtime.flwr_cli.Watch` that gives up when the SuperLink
    exits. Everything it started is stopped after, by process id."""
    home = Path(env["FLWR_HOME"])
    (home / "local-superlink").mkdir(parents=True, exist_ok=True)
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    log_file = home / "local-superlink" / "superlink.log"
    command = [
        "flower-superlink",
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--control-api-address",
        f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--log-file",
        str(log_file),
        "--database",
        str(home / "local-superlink" / "state.db"),
    ]
    tree = start_process(command, env, process_folder(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def watch() -> str | None:
        tree.refresh()
        if tree.process.poll() is None:
            return None
        return (
            f"flower-superlink exited with {exit_description(tree.process.returncode)}; the end of its "
            f"log:\n{log_tail(log_file)}"
        )

    try:
        deadline = time.monotonic() + startup_timeout_s
        while not healthy(f"http://127.0.0.1:{port}/health"):
            if tree.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flower-superlink did not start; the end of its log:\n{log_tail(log_file)}")
            time.sleep(0.25)
        yield watch
    finally:
        stop_processes([tree])
