"""Sweeps as the tests run them: the tiny job's overrides, Hydra's composed config, the sweep command (in a process
of its own, or in the test's), and a job's folder as the sweep leaves it."""

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from alignfl.fl_app import sweep as command
from alignfl.fl_app.sweeps.sweep import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY = ["dataset=digits", "sim.num_supernodes=2", "train.num_server_rounds=1"]


def composed(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m alignfl.fl_app.sweep -m OVERRIDES`` in a process of its own, its folder ``tmp_path``."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "alignfl.fl_app.sweep", "-m", *overrides, f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def command_in_process(capfd: pytest.CaptureFixture[str], *arguments: str) -> subprocess.CompletedProcess:
    """``python -m alignfl.fl_app.sweep ARGUMENTS`` run in the test's process, reported as :func:`sweep` reports its
    subprocess (exit status, stdout, stderr, from the file descriptors, so what a child process or a C library
    writes there counts too). For a command refused before any job starts: a process of its own would spend
    seconds importing torch, Flower and Hydra to check nothing more. What the command changes is put back
    afterwards: its argv, environment and working folder, logging (Hydra configures it), Hydra's global state.
    What the test wrote before is dropped from the capture, not counted as the command's."""
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch, _logging_restored(), _global_hydra_set_aside():
        patch.setattr(sys, "argv", [command.__file__, *arguments])  # argv[0] as `python -m` sets it
        patch.setenv("FLWR_TELEMETRY_ENABLED", "0")
        patch.chdir(ROOT)
        status = _exit_status(command.main)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([sys.executable, "-m", command.__name__, *arguments], status, out, err)


def _exit_status(main: Callable[[], None]) -> int:
    """The status the interpreter exits with after ``main()``: 0 when it returns, else its SystemExit's code (a
    message is printed to stderr and exits 1, as Python does). Any other exception is raised: the test fails
    with its traceback, where the subprocess would have printed it and exited 1."""
    try:
        main()
    except SystemExit as exited:
        if exited.code is None or isinstance(exited.code, int):
            return exited.code or 0
        print(exited.code, file=sys.stderr)
        return 1
    return 0


@contextmanager
def _logging_restored() -> Iterator[None]:
    """Hydra configures logging as a command starts (``logging.config.dictConfig``: the root logger's handlers,
    pytest's among them, replaced by a console handler on this test's captured stdout, and its level set): every
    logger there before gets its handlers, level and flags back, so later tests in the worker log as before."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    saved = [
        (logger, logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for logger in loggers
        if isinstance(logger, logging.Logger)  # not a PlaceHolder, a name no logger has taken yet
    ]
    try:
        yield
    finally:
        for logger, level, handlers, propagate, disabled in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled


@contextmanager
def _global_hydra_set_aside() -> Iterator[None]:
    """The command initialises Hydra's global instance and clears it on its way out, and refuses to start while
    one is initialised: one a caller holds (``initialize_config_dir``) is set aside meanwhile and put back."""
    global_hydra = GlobalHydra.instance()
    held = global_hydra.hydra
    global_hydra.clear()
    try:
        yield
    finally:
        global_hydra.clear()
        if held is not None:
            global_hydra.initialize(held)


def fake_job(folder: Path, overrides: list[str], status: str | None, final: float = 0.0, best: float = 0.0) -> None:
    """A job folder as alignfl.fl_app.sweeps.sweep leaves it: Hydra's overrides record, job.json, the run's
    summary.json."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if status is None:  # the job died before writing its record
        return
    run = folder / "run"
    record = {
        "status": status,
        "error": None if status == "completed" else "RuntimeError: boom",
        "run-folder": str(run) if status == "completed" else None,
        "job-wall-time-s": 10.0 + final,
    }
    (folder / "job.json").write_text(json.dumps(record))
    if status == "completed":
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"final-accuracy": final, "best-accuracy": best}))
