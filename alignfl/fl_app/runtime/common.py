"""What the runtime's modules share: a free port, a folder check, and the folders a command makes for its
processes, which it leaves behind only where the user asked for them. Where the project's own files are (a
checkout or an installed package) is :mod:`alignfl.fl_app.locations`'s."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alignfl.fl_app.config import ConfigError, path_problem
from alignfl.fl_app.runtime.processes import stops_deferred


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
            f"{option} {str(folder)!r} is not allowed: it must be a folder of your own that this user can write "
            f"to ({problem})"
        )


RAY_SOCKET_ROOM = 68
"""Characters Ray (2.55) adds to its temporary folder for its longest socket path
(``/ray/session_<date>_<time>_<pid>/sockets/plasma_store``, a pid of up to 7 digits)."""
AF_UNIX_PATH_MAX = 107
"""The longest socket path Ray accepts on Linux."""


@contextmanager
def scratch_folder(prefix: str, short: bool = False) -> Iterator[Path]:
    """A new folder in the system's temporary folder (``$TMPDIR``) for files only the processes a command starts
    need (Flower homes, staged apps, Ray's sessions), removed with everything in it however the block is left (a
    stop signal included: :class:`alignfl.fl_app.runtime.processes.Stopped` unwinds through here).

    ``short``: a folder Ray keeps its sockets in, made in ``/tmp`` where ``$TMPDIR`` is too long a path for them.
    """
    parent = None
    made = len(str(Path(tempfile.gettempdir()).resolve())) + 1 + len(prefix) + 8  # mkdtemp adds 8 characters
    if short and made + RAY_SOCKET_ROOM > AF_UNIX_PATH_MAX:
        parent = "/tmp"
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent)).resolve()
    try:
        yield folder
    finally:
        with stops_deferred():
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def made_folder(folder: Path) -> Iterator[Path]:
    """``folder`` (absolute), made with any missing parents; after the block, each of those it made that is still
    empty is removed again (a command that refused or failed before writing there leaves no empty folder behind).
    A folder that existed before is left as it was, and nothing written in one is ever removed."""
    folder = folder.resolve()
    made = [level for level in (folder, *folder.parents) if not level.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    finally:
        for level in made:
            try:
                level.rmdir()
            except OSError:  # not empty (or already gone): it, and every folder above it, stays
                break


@contextmanager
def work_folder(given: Path | None, prefix: str) -> Iterator[Path]:
    """``--work-dir`` as :func:`made_folder`, kept with what the services wrote there; without it a
    :func:`scratch_folder`, removed with everything in it."""
    if given is not None:
        with made_folder(given) as folder:
            yield folder
    else:
        with scratch_folder(prefix) as folder:
            yield folder
