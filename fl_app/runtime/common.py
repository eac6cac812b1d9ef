"""What the runtime's modules share: the project folder, a free port, a folder check."""

from __future__ import annotations

import socket
from pathlib import Path

from fl_app.config import ConfigError, path_problem

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The project folder: ``flwr run`` builds the app from it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_folder(option: str, folder: Path) -> None:
    """Refuse a folder the deployment must write to but cannot, naming the option."""
    problem = path_problem(folder, writable=True)
    if problem is not None:
        raise ConfigError(
            f"{option} {str(folder)!r} is not allowed: it must be a folder this user can write to ({problem})"
        )
