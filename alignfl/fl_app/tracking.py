"""Experiment tracking: every round of a run in TensorBoard (on by default) and MLflow (when asked for).

The ServerApp opens a :class:`Tracking` for its run folder and hands it the metrics rows (the lines of
``metrics.jsonl``) after each round's checkpoint is written, so a round is tracked once it is durable:

- ``tracking=tensorboard`` (default): event files in the run folder; every number of a row becomes a scalar
  with the round as the step (``accuracy`` and ``loss`` in the rounds the server evaluated,
  ``units-moved/<group>``, ``local-accuracy-per-client/<id>``, a list as ``<key>/<index>``), the run config
  and the machine (:func:`run_parameters`) as text, the summary's figures as ``summary/<key>``.
- ``tracking=mlflow``: one MLflow run per alignfl run in the store at ``mlflow-uri`` (default a SQLite file in
  the results folder): the run config and the machine as parameters, tags for the algorithm, model, data,
  partitioner, seed, git commit and Flower version, the same metrics with the round as the step, the summary's
  figures, and the run folder's plots, config, metrics, summary and final model as artifacts. Its id is kept in
  ``tracking.json`` in the run folder, so ``resume-from`` continues the same MLflow run.
- ``both`` or ``none``.

Tracking never costs a run: a sink that fails (an unreachable server, a locked or unwritable database)
warns once and is switched off; ``metrics.jsonl`` stays the record and ``summary.json``'s ``tracking`` entry
says what was not tracked. Only the ServerApp tracks; clients need no access to the store.

A resumed run writes TensorBoard events from step 0 again, after a purge marker that hides the earlier
session's steps from that step on, so each round shows once whatever the earlier session flushed; MLflow
gets the rounds after the last step the run already holds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from logging import WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.common.logger import log

from alignfl.core.config import RunConfig, results_root
from alignfl.fl_app.provenance import git_commit, machine
from alignfl.fl_app.results import write_json
from alignfl.plugins.options import refuse

TRACKING_FILE = "tracking.json"
SUMMARY_KEY = "tracking"
EXPERIMENT = "alignfl"
INSTALL_MLFLOW = "pip install 'alignfl[mlflow]'"
PARENT_RUN_ENV = "ALIGNFL_MLFLOW_PARENT_RUN_ID"
"""Set by a sweep job (:mod:`alignfl.fl_app.sweeps.tracking`): the MLflow run the job's run is a child of."""
RUN_NAME_ENV = "ALIGNFL_MLFLOW_RUN_NAME"
"""Set by a sweep job: the child run's name (its overrides)."""
ARTIFACTS = ("config.json", "metrics.jsonl", "model.pt")
"""Run-folder files logged as MLflow artifacts, besides every plot and (last) ``summary.json``."""
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
"""A remote store that stops answering costs seconds, not MLflow's default minutes of retries (set only where
the user has not set them)."""
TENSORBOARD_ON = ("tensorboard", "both")
MLFLOW_ON = ("mlflow", "both")
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")
NOT_FIGURES = ("clients-per-round", "machine")
"""Summary entries that are no figure of the run (the machine's thread counts are no metric)."""
MACHINE_PREFIX = "machine."


def wants_tensorboard(config: RunConfig) -> bool:
    return config.tracking in TENSORBOARD_ON


def wants_mlflow(config: RunConfig) -> bool:
    return config.tracking in MLFLOW_ON


def mlflow_uri(config: RunConfig) -> str:
    """``mlflow-uri``, or a SQLite database in the results folder."""
    return config.mlflow_uri or f"sqlite:///{(results_root(config) / 'mlflow.db').resolve()}"


def check_tracking(config: RunConfig) -> None:
    """Refuse ``tracking=mlflow|both`` where MLflow is not installed, before anything starts."""
    if wants_mlflow(config) and importlib.util.find_spec("mlflow") is None:
        raise refuse(
            "tracking",
            config.tracking,
            f"needs MLflow, which is not installed here: {INSTALL_MLFLOW} (or choose tensorboard or none)",
        )


def run_parameters(config: RunConfig) -> dict[str, Any]:
    """The run config and, as ``machine.<key>``, the machine the run's figures came from (floats and times differ
    across CPUs and thread counts)."""
    return {**config.to_run_config(), **{MACHINE_PREFIX + key: value for key, value in machine().items()}}


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a metrics row by name (the round left out): a dict's entries as ``key/sub``, a list's as
    ``key/index``; strings and None are left out."""
    values: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for sub, item in value.items():
                add(f"{name}/{sub}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                add(f"{name}/{index}", item)
        elif isinstance(value, (bool, int, float)):
            values[_UNSAFE.sub("_", name)] = float(value)

    for key, value in row.items():
        if key != "round":
            add(key, value)
    return values


def read_tracking_file(folder: Path) -> dict[str, Any]:
    path = folder / TRACKING_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


class Sink(Protocol):
    """One tracking backend of a run."""

    name: str

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        """Track the rows not tracked yet (each row once)."""

    def finish(self, summary: Mapping[str, Any], folder: Path) -> None:
        """Track the summary's figures and the run folder's results (``summary.json`` aside)."""

    def seal(self, folder: Path) -> None:
        """Track the final ``summary.json`` (written after :meth:`finish`, with what was tracked): the run is done."""

    def close(self, failed: bool) -> None:
        """Release the backend; ``failed``: the run ended with an error."""


class TensorBoardSink:
    """Event files in the run folder (``tensorboard --logdir <run folder>``)."""

    name = "tensorboard"

    def __init__(self, folder: Path, config: RunConfig, resumed: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run writes everything again after a purge marker at step 0: TensorBoard then hides what the
        # earlier session wrote (flushed or not, past its last checkpoint or not), so every round shows once.
        self.writer = SummaryWriter(str(folder), purge_step=0 if resumed else None, flush_secs=30)
        self.config_text = "\n".join(
            ["| key | value |", "|---|---|"] + [f"| {key} | {value} |" for key, value in run_parameters(config).items()]
        )
        self.last_round = -1

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        if self.last_round < 0 and rows:
            self.writer.add_text("run-config", self.config_text, 0)
        for row in rows:
            if row["round"] > self.last_round:
                for tag, value in scalars(row).items():
                    self.writer.add_scalar(tag, value, row["round"])
                self.last_round = row["round"]
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any], folder: Path) -> None:
        step = int(summary.get("rounds", 0))
        for tag, value in scalars({k: v for k, v in summary.items() if k not in NOT_FIGURES}).items():
            self.writer.add_scalar(f"summary/{tag}", value, step)
        self.writer.flush()

    def seal(self, folder: Path) -> None:
        """The summary's figures are in the event files already."""

    def close(self, failed: bool) -> None:
        self.writer.close()


def _probe(uri: str) -> None:
    """Fail fast when an HTTP tracking server does not answer (before MLflow's retries would wait)."""
    if uri.startswith(("http://", "https://")):
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as reply:
            reply.read()


def _artifact_location(uri: str) -> str | None:
    """Where a SQLite store's experiment keeps artifacts: beside the database (MLflow's default is the working
    directory, which is a copy for ``flwr run``); a server decides for itself."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts").as_uri()
    return None


def mlflow_client(uri: str) -> Any:
    """An :class:`mlflow.MlflowClient` on ``uri`` (checked to answer), with short HTTP retries."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    _probe(uri)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client: Any, uri: str) -> str:
    """The ``alignfl`` experiment's id, made on first use."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(EXPERIMENT, artifact_location=_artifact_location(uri))


def log_in_batches(client: Any, run_id: str, *, metrics: Iterable[Any] = (), params: Iterable[Any] = ()) -> None:
    """``log_batch`` within MLflow's limits (1000 metrics, 100 parameters a call)."""
    metrics, params = list(metrics), list(params)
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    for start in range(0, len(params), 100):
        client.log_batch(run_id, params=params[start : start + 100])


class MlflowSink:
    """One MLflow run per alignfl run; a resumed run continues it."""

    name = "mlflow"

    def __init__(self, folder: Path, config: RunConfig, resumed: bool) -> None:
        from mlflow.entities import Param

        self.uri = mlflow_uri(config)
        self.client = mlflow_client(self.uri)
        self.finished = False
        kept = read_tracking_file(folder).get("mlflow", {}) if resumed else {}
        self.run_id = self._continued(kept) if kept.get("tracking-uri") == self.uri else None
        if self.run_id is None:
            self.last_round = -1
            self.run_id = self._new_run(folder, config)
            log_in_batches(
                self.client,
                self.run_id,
                params=[Param(key, str(value)) for key, value in run_parameters(config).items()],
            )
        write_json(folder / TRACKING_FILE, {"mlflow": {"tracking-uri": self.uri, "run-id": self.run_id}})

    def _continued(self, kept: Mapping[str, Any]) -> str | None:
        """The earlier session's run, set running again; None when the store no longer has it."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(kept["run-id"])
        except MlflowException:
            return None
        self.client.update_run(kept["run-id"], status="RUNNING")
        history = self.client.get_metric_history(kept["run-id"], "elapsed-s")  # every row has it
        self.last_round = max((metric.step for metric in history), default=-1)
        return str(kept["run-id"])

    def _new_run(self, folder: Path, config: RunConfig) -> str:
        import flwr

        tags = {
            "strategy": config.strategy,
            "model": config.model,
            "dataset": config.dataset,
            "partitioner": config.partitioner,
            "seed": str(config.seed),
            "flwr-version": flwr.__version__,
            "mlflow.source.git.commit": git_commit(),
            "run-folder": str(folder),
        }
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        name = os.environ.get(RUN_NAME_ENV) or folder.name
        run = self.client.create_run(experiment_id(self.client, self.uri), tags=tags, run_name=name)
        return str(run.info.run_id)

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = [row for row in rows if row["round"] > self.last_round]
        log_in_batches(
            self.client,
            self.run_id,
            metrics=[
                Metric(key, value, now, int(row["round"])) for row in fresh for key, value in scalars(row).items()
            ],
        )
        if fresh:
            self.last_round = fresh[-1]["round"]

    def finish(self, summary: Mapping[str, Any], folder: Path) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.get("rounds", 0))
        figures = {k: v for k, v in summary.items() if k not in NOT_FIGURES}
        log_in_batches(
            self.client,
            self.run_id,
            metrics=[Metric(key, value, now, step) for key, value in scalars(figures).items() if math.isfinite(value)],
        )
        for path in [*sorted(folder.glob("*.png")), *(folder / name for name in ARTIFACTS)]:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def seal(self, folder: Path) -> None:
        self.client.log_artifact(self.run_id, str(folder / "summary.json"))
        self.client.set_terminated(self.run_id, "FINISHED")
        self.finished = True

    def close(self, failed: bool) -> None:
        if not self.finished:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "KILLED")


class Tracking:
    """The run's sinks, each switched off with one warning at its first failure."""

    def __init__(self, sinks: list[Sink], problems: dict[str, str]) -> None:
        self.sinks = sinks
        self.problems = problems
        self.round = 0

    @classmethod
    def open(cls, config: RunConfig, folder: Path, resumed: bool) -> Tracking:
        """The sinks ``tracking`` asks for; one that cannot start is reported, and the run goes on."""
        kinds: list[tuple[str, Callable[..., Sink]]] = []
        if wants_tensorboard(config):
            kinds.append(("tensorboard", TensorBoardSink))
        if wants_mlflow(config):
            kinds.append(("mlflow", MlflowSink))
        tracking = cls([], {})
        for name, kind in kinds:
            try:
                tracking.sinks.append(kind(folder, config, resumed))
            except Exception as error:  # tracking never costs a run
                tracking._fail(name, "could not start", error)
        return tracking

    def _fail(self, name: str, when: str, error: BaseException) -> None:
        reason = f"{when}: {type(error).__name__}: {error}".strip()
        self.problems[name] = reason
        log(
            WARNING,
            "[alignfl] %s tracking is off for the rest of this run (%s); the run goes on and "
            "metrics.jsonl keeps every round",
            name,
            reason,
        )

    def _each(self, when: str, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as error:  # tracking never costs a run
                self.sinks.remove(sink)
                self._fail(sink.name, when, error)
                try:
                    sink.close(failed=True)
                except Exception:  # the backend is gone already; its warning is out
                    pass

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        """Track the rows the sinks have not had (after each round's checkpoint)."""
        if rows:
            self.round = rows[-1]["round"]
        self._each(f"from round {self.round} on", lambda sink: sink.log_rows(rows))

    def finish(self, summary: dict[str, Any], folder: Path) -> dict[str, Any]:
        """Track the summary and the run folder's results; returns the summary with its ``tracking`` entry, which
        is also written to ``summary.json`` (logged last)."""
        self._each("at the end of the run", lambda sink: sink.finish(summary, folder))
        summary = {**summary, SUMMARY_KEY: self.status()}
        write_json(folder / "summary.json", summary)
        self._each("at the end of the run", lambda sink: sink.seal(folder))
        if summary[SUMMARY_KEY] != self.status():  # the last upload failed: say so on disk
            summary = {**summary, SUMMARY_KEY: self.status()}
            write_json(folder / "summary.json", summary)
        return summary

    def status(self) -> dict[str, str]:
        """Per backend asked for: ``complete``, or what was not tracked and why."""
        status = {sink.name: "complete" for sink in self.sinks}
        status.update({name: f"not tracked {reason}" for name, reason in self.problems.items()})
        mlflow = next((sink for sink in self.sinks if isinstance(sink, MlflowSink)), None)
        if mlflow is not None:
            status["mlflow-run-id"] = mlflow.run_id
        return status

    def close(self, failed: bool) -> None:
        """Flush and release every sink (also after an error)."""
        self._each("while closing", lambda sink: sink.close(failed))
