"""Where alignfl's own files are, in a checkout or an installed package, and where a run may not write.

A checkout holds, beside its packages, ``pyproject.toml`` (the Flower app's manifest: ``flwr run`` reads its
``[tool.flwr]`` sections), ``conf/`` (Hydra's configs) and ``scripts/``. The wheel carries those the commands
read as package data under ``alignfl/`` (``[tool.hatch.build.targets.wheel.force-include]`` in
``pyproject.toml``, one line for each of :data:`SHIPPED`), so :func:`shipped` finds each in either place.
Processes start in the checkout, or, installed, in the current folder (:func:`process_folder`), and no run
writes into site-packages or alignfl's own package folder (:func:`own_folder_problem`): a reinstall replaces
them, and other users of the same Python may share them.
"""

from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

IMPORT_ROOT = Path(__file__).resolve().parents[__name__.count(".")]
"""The folder on ``sys.path`` holding alignfl's top-level packages: a checkout's root, or site-packages. The one
path alignfl's packages compute from a module's own file; it holds however deep this module sits."""
PACKAGE_FOLDER = IMPORT_ROOT / __name__.split(".")[0]
"""The ``alignfl`` package's folder; the wheel also puts there the checkout's files an installed alignfl reads
(:data:`SHIPPED`)."""
SHIPPED = ("conf", "pyproject.toml", "scripts/make_certs.sh")
"""The checkout's files the commands read, relative to its root: Hydra's configs, the Flower app's manifest,
the script that makes a TLS deployment's keys. The wheel ships each under :data:`PACKAGE_FOLDER`."""


def checkout_root() -> Path | None:
    """The checkout alignfl runs from (``pyproject.toml`` and ``conf/`` beside its packages), or None where it
    runs from an installed package."""
    found = (IMPORT_ROOT / "pyproject.toml").is_file() and (IMPORT_ROOT / "conf").is_dir()
    return IMPORT_ROOT if found else None


def shipped(relative: str) -> Path:
    """The project's file or folder ``relative`` (one of :data:`SHIPPED`): the checkout's, else the installed
    package's copy."""
    if relative not in SHIPPED:
        raise ValueError(f"{relative!r} is not among the files the wheel ships {SHIPPED}")
    root = checkout_root()
    return (root if root is not None else PACKAGE_FOLDER) / relative


def process_folder() -> Path:
    """The working folder of the processes a command starts (SuperLink, ``flwr``, Ray): the checkout, or, for an
    installed alignfl, the current folder, never the package's."""
    root = checkout_root()
    return root if root is not None else Path.cwd()


def own_folders() -> list[Path]:
    """The folders no run writes into: every site-packages folder this Python imports from, and alignfl's own
    code (installed: all of its site-packages; in a checkout: its package folder, not the checkout's root, where
    measurements such as ``benchmarks/runs`` go)."""
    candidates = [
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
        *site.getsitepackages(),
        site.getusersitepackages(),
        *(entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")),
    ]
    folders = {Path(folder).resolve() for folder in candidates}
    folders.add(PACKAGE_FOLDER if checkout_root() is not None else IMPORT_ROOT)
    return sorted(folders)


def own_folder_problem(path: Path) -> str | None:
    """Why ``path`` is no place to write to (it is inside one of :func:`own_folders`), or None."""
    resolved = path.expanduser().resolve()
    inside = [folder for folder in own_folders() if resolved.is_relative_to(folder)]
    if not inside:
        return None
    return f"{resolved} lies inside {inside[0]}, where Python's packages or alignfl's own code are installed"


def program(module: str, *rest: str) -> str:
    """A command's program name for its ``--help`` usage, as the user called it: ``alignfl <command>`` from the
    console script (:func:`alignfl.fl_app.cli.main` sets ``sys.argv[0]`` so), else ``python -m <module>``;
    ``rest`` follows it (a deployment role)."""
    called = sys.argv[0] if sys.argv and sys.argv[0].startswith("alignfl") else f"python -m {module}"
    return " ".join([called, *rest])
