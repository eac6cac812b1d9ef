"""Which commit of the project a run's code came from, also where that code runs from a copy.

``flwr run`` ships the project to its ServerApp and ClientApps as a FAB, installed outside any git checkout, so
the code cannot ask git where it came from. The launcher and the deployment, which run in the checkout, put the
commit into the environment of every Flower process they start (:data:`COMMIT_ENV`, read first by
:func:`git_commit`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

COMMIT_ENV = "ALIGNFL_GIT_COMMIT"
UNKNOWN = "unknown"


def checkout_commit(folder: Path = Path(__file__).parent) -> str:
    """The commit checked out where ``folder`` is, or ``unknown`` outside a git checkout (or without git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return done.stdout.strip() if done.returncode == 0 else UNKNOWN


def git_commit() -> str:
    """The project's commit: the one its launcher passed on (:data:`COMMIT_ENV`), else this code's checkout's."""
    return os.environ.get(COMMIT_ENV) or checkout_commit()
