"""Where a deployment's certificates and private keys live, and the check that git cannot publish them.

``scripts/make_certs.sh``, ``python -m alignfl.fl_app.deploy --tls`` and its roles keep the CA, the SuperLink's
certificate and every SuperNode's keys in :func:`default_certs` (``$XDG_STATE_HOME/alignfl/certs``, by
default ``~/.local/state/alignfl/certs``) unless ``--certs`` names another folder: outside the checkout,
so that one ``git add -A`` does not publish them. The launcher, deploy and the roles refuse to start while
a private key sits in a git work tree that would commit it (:func:`refuse_exposed_keys`), or while the folder
keys are to be made in is one (:func:`refuse_committable_folder`, what ``make_certs.sh`` refuses).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from alignfl.plugins.options import ConfigError

PRIVATE_KEY = re.compile(rb"^-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----\s*$", re.MULTILINE)
"""The first line of a PEM or OpenSSH private key (``PRIVATE KEY``, ``EC PRIVATE KEY``, ``OPENSSH PRIVATE KEY``,
``ENCRYPTED PRIVATE KEY``, ...)."""
HEAD_BYTES = 65536
"""How much of a file is searched for a private key: keys are a few kB, and a PEM bundle puts them early."""


def default_certs() -> Path:
    """``$XDG_STATE_HOME/alignfl/certs`` (``~/.local/state/alignfl/certs`` when it is unset or relative)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    root = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return root / "alignfl" / "certs"


def holds_private_key(path: Path) -> bool:
    """Whether the file's first :data:`HEAD_BYTES` bytes hold a private key's first line."""
    try:
        with path.open("rb") as file:
            return PRIVATE_KEY.search(file.read(HEAD_BYTES)) is not None
    except OSError:  # unreadable, or gone meanwhile: git could not add it either
        return False


def work_tree(folder: Path) -> Path | None:
    """The top of the git work tree holding ``folder`` (or the nearest folder above it that exists), or None."""
    existing = folder.resolve()
    while not existing.is_dir():
        existing = existing.parent
    try:
        found = subprocess.run(
            ["git", "-C", str(existing), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):  # no git here: nothing can be committed with it
        return None
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def exposed_private_keys(folder: Path) -> list[Path]:
    """The files under ``folder`` holding a private key that git would commit: tracked ones, and untracked ones
    its ignore rules do not cover."""
    tree = work_tree(folder)
    if tree is None or not folder.exists():
        return []
    listed = subprocess.run(
        ["git", "-C", str(tree), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", str(folder)],
        capture_output=True,
        timeout=60,
    )
    names = {name for name in listed.stdout.decode(errors="surrogateescape").split("\0") if name}
    return sorted(path for path in (tree / name for name in names) if path.is_file() and holds_private_key(path))


def refuse_exposed_keys(*folders: Path | None) -> None:
    """Refuse to start while a private key under one of ``folders`` (the checkout, ``--certs``) could be
    committed, naming the files; a ConfigError."""
    exposed = sorted({path for folder in folders if folder is not None for path in exposed_private_keys(folder)})
    if exposed:
        shown = ", ".join(str(path) for path in exposed[:10]) + (
            f" and {len(exposed) - 10} more" if len(exposed) > 10 else ""
        )
        raise ConfigError(
            f"private keys inside a git work tree that does not ignore them: {shown}; `git add` would publish "
            f"them. Move them out (the default key folder is {default_certs()}) or have .gitignore cover them"
        )


def refuse_committable_folder(option: str, folder: Path) -> None:
    """Refuse a folder to make private keys in that git would commit, before anything starts: ``make_certs.sh``
    refuses it too, but only once a deployment is on its way; a ConfigError naming the option."""
    tree = work_tree(folder)
    if tree is None:
        return
    key = folder.resolve() / "ca.key"
    try:
        ignored = subprocess.run(
            ["git", "-C", str(tree), "check-ignore", "-q", str(key)], capture_output=True, timeout=30
        ).returncode
    except (OSError, subprocess.TimeoutExpired):  # git went away meanwhile: nothing can be committed with it
        return
    if ignored != 0:
        raise ConfigError(
            f"{option} {str(folder)!r} is not allowed: it is inside the git work tree {tree}, which does not ignore "
            f"it, so `git add` would publish the private keys made there. Give a folder outside it (the default is "
            f"{default_certs()}) or one its .gitignore covers"
        )
