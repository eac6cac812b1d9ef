"""Sweeps as the tests run them: the tiny job's overrides, Hydra's composed config, the sweep command, and a job's
folder as the sweep leaves it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir

from alignfl.fl_app.sweeps.sweep import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY = ["dataset=digits", "sim.num_supernodes=2", "train.num_server_rounds=1"]


def composed(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "alignfl.fl_app.sweep", "-m", *overrides, f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


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
