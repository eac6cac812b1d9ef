"""A sweep in the trackers: TensorBoard's HParams view over its jobs, and one MLflow parent run with a child per job.

- TensorBoard: after the sweep (:mod:`alignfl.fl_app.sweeps.report`), each completed job's run folder gets its
  hyper-parameters (the swept keys and the seed) and final figures as an HParams session, and the sweep folder
  the experiment that lists them; ``tensorboard --logdir <sweep folder>`` then shows the T/A/α grid in its HParams
  view beside every run's curves. Written again (not appended) when the report is written again.
- MLflow (``tracking=mlflow|both``): the first job makes the sweep's parent run (under a file lock, so jobs
  of a parallel launcher agree on one) and records it in the sweep folder; each job's run is its child
  (:data:`alignfl.fl_app.tracking.PARENT_RUN_ENV`), named by its overrides. At the end the parent gets the swept values
  as parameters, the report's files as artifacts, and its status.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from logging import WARNING
from pathlib import Path
from typing import Any

import flwr
from flwr.common.logger import log

from alignfl.core.config import RunConfig
from alignfl.fl_app.provenance import git_commit
from alignfl.fl_app.results import write_json
from alignfl.fl_app.tracking import (
    PARENT_RUN_ENV,
    RUN_NAME_ENV,
    TENSORBOARD_ON,
    experiment_id,
    log_in_batches,
    mlflow_client,
    mlflow_uri,
    wants_mlflow,
)

PARENT_FILE = "mlflow-sweep.json"
HPARAMS_SUFFIX = ".alignfl-hparams"
HPARAMS_METRICS = ("final-accuracy", "best-accuracy", "last-5-mean-accuracy", "wall-time-s")
"""summary.json figures shown as the HParams view's metric columns (as ``hparams/<name>``)."""


def _value(text: str) -> float | str:
    """An override's value as TensorBoard should sort it: a number where it is one."""
    try:
        return float(text)
    except ValueError:
        return text


def write_hparams(sweep_dir: Path, sessions: list[tuple[Path, Mapping[str, str], Mapping[str, Any]]]) -> None:
    """TensorBoard's HParams view of the sweep (:func:`_write_hparams`); it is an extra view, so a run folder that
    has moved since is left out and a folder that cannot be written is a warning, not a failed report."""
    present = [session for session in sessions if session[0].is_dir()]
    for run_folder in sorted({str(session[0]) for session in sessions} - {str(session[0]) for session in present}):
        log(WARNING, "[alignfl] HParams view: run folder %s is gone; its job is left out", run_folder)
    try:
        _write_hparams(sweep_dir, present)
    except OSError as error:
        log(WARNING, "[alignfl] HParams view not written (%s); the sweep's summary files are", error)


def _write_hparams(sweep_dir: Path, sessions: list[tuple[Path, Mapping[str, str], Mapping[str, Any]]]) -> None:
    """One HParams session per completed job (run folder, swept settings, summary) whose run has TensorBoard on,
    and the experiment that lists them, in the sweep folder. The seed is read from each run's config.json."""
    from torch.utils.tensorboard.summary import hparams

    table = []
    for run_folder, settings, summary in sessions:
        config_path = run_folder / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if config.get("tracking") not in TENSORBOARD_ON:
            continue
        values = {**{key: _value(value) for key, value in settings.items()}, "seed": float(config["seed"])}
        metrics = {
            f"hparams/{name}": float(summary[name])
            for name in HPARAMS_METRICS
            if isinstance(summary.get(name), (int, float))
        }
        table.append((run_folder, values, metrics))
    if not table:
        return
    domains = {
        key: sorted({values[key] for _, values, _ in table if key in values}, key=str)
        for key in table[0][1]
        if all(isinstance(values.get(key), str) for _, values, _ in table)
    }
    metric_names = {name: 0.0 for _, _, metrics in table for name in metrics}
    experiment, _, _ = hparams(table[0][1], metric_names, domains)
    with _fresh_writer(sweep_dir) as writer:  # the experiment: which hyper-parameters and metrics the view has
        writer.file_writer.add_summary(experiment)
    for folder, values, metrics in table:
        _, start, end = hparams(values, metrics, domains)
        with _fresh_writer(folder) as writer:
            writer.file_writer.add_summary(start)
            writer.file_writer.add_summary(end)
            for name, value in metrics.items():
                writer.add_scalar(name, value, 0)


def _fresh_writer(folder: Path) -> Any:
    """A writer of this module's event file in ``folder``, the one an earlier report wrote removed."""
    from torch.utils.tensorboard import SummaryWriter

    for stale in folder.glob(f"events.out.tfevents.*{HPARAMS_SUFFIX}"):
        stale.unlink()
    return SummaryWriter(str(folder), filename_suffix=HPARAMS_SUFFIX)


def sweep_store(config: RunConfig, sweep_dir: Path | None) -> RunConfig:
    """A multirun job's config with the default MLflow store the sweep's (``<sweep folder>/mlflow.db``), not its
    own job folder's, so that every job's run lands beside the parent run."""
    if sweep_dir is None or not wants_mlflow(config) or config.mlflow_uri:
        return config
    return config.replace(mlflow_uri=f"sqlite:///{(sweep_dir / 'mlflow.db').resolve()}")


def _parent_run(config: RunConfig, sweep_dir: Path) -> str:
    """The sweep's MLflow parent run, made by the first job that asks (under a lock in the sweep folder)."""
    uri = mlflow_uri(config)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with (sweep_dir / ".mlflow-sweep.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = sweep_dir / PARENT_FILE
        if record.is_file():
            kept = json.loads(record.read_text())
            if kept["tracking-uri"] == uri:
                return str(kept["run-id"])
        client = mlflow_client(uri)
        run = client.create_run(
            experiment_id(client, uri),
            run_name=f"sweep {sweep_dir.name}",
            tags={
                "sweep-dir": str(sweep_dir),
                "mlflow.source.git.commit": git_commit(),
                "flwr-version": flwr.__version__,
            },
        )
        write_json(record, {"tracking-uri": uri, "run-id": run.info.run_id})
        return str(run.info.run_id)


@contextmanager
def sweep_child(config: RunConfig, sweep_dir: Path | None, job_dir: Path) -> Iterator[None]:
    """While one job of a multirun runs: its MLflow run is a child of the sweep's parent, named by its folder."""
    if sweep_dir is None or not wants_mlflow(config):
        yield
        return
    try:
        parent: str | None = _parent_run(config, sweep_dir)
    except Exception as error:  # tracking never costs a run: the job's own run reports its tracking
        log(
            WARNING,
            "[alignfl] the sweep's MLflow parent run could not be made (%s: %s); the job's run is not nested",
            type(error).__name__,
            error,
        )
        parent = None
    names = {PARENT_RUN_ENV: parent, RUN_NAME_ENV: str(job_dir.resolve().relative_to(sweep_dir.resolve()))}
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: value for name, value in names.items() if value})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def finish_sweep_run(
    sweep_dir: Path, swept: Mapping[str, list[str]], jobs: int, failed: int, files: list[Path]
) -> None:
    """Close the sweep's MLflow parent run (if it has one): swept values as parameters, the report as artifacts."""
    record = sweep_dir / PARENT_FILE
    if not record.is_file():
        return
    kept = json.loads(record.read_text())
    try:
        from mlflow.entities import Metric, Param

        client = mlflow_client(kept["tracking-uri"])
        now = int(time.time() * 1000)
        log_in_batches(
            client,
            kept["run-id"],
            params=[Param(f"swept.{key}", ",".join(values)) for key, values in swept.items()],
            metrics=[Metric("jobs", jobs, now, 0), Metric("jobs-failed", failed, now, 0)],
        )
        for path in files:
            client.log_artifact(kept["run-id"], str(path))
        client.set_terminated(kept["run-id"], "FAILED" if failed else "FINISHED")
    except Exception as error:  # the report on disk is the record
        log(
            WARNING,
            "[alignfl] the sweep's MLflow parent run could not be closed (%s: %s); %s holds the report",
            type(error).__name__,
            error,
            sweep_dir,
        )
