"""One run, one folder: resolved config, per-round metrics, summary, plot and final model.

``metrics.jsonl`` is appended and flushed every round, so a run that stops early
keeps every round it finished. A round the server does not score the global model in
(``server-evaluate-every``) has no ``accuracy`` and ``loss`` in its row.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from alignfl.core.config import RunConfig, results_root
from alignfl.core.merging.drift import MOVED_BETWEEN, MOVED_FROM_START
from alignfl.core.metrics.divergence import divergence_by_layer, weight_divergence
from alignfl.core.rounds.replies import MODEL_RECORD, NEW_CLIENT, drop_cause
from alignfl.core.rounds.runner import Participation
from alignfl.fl_app.patches import seam
from alignfl.fl_app.provenance import git_commit, machine

GlobalEvaluation = Callable[[ArrayRecord], tuple[float, float]]


def make_run_folder(config: RunConfig) -> Path:
    """Create the run's folder (absolute), named by ``run-name`` or by time, algorithm, model, data and seed."""
    name = config.run_name or (
        f"{datetime.now(UTC):%Y%m%d-%H%M%S-%f}_{config.strategy}_{config.model}_"
        f"{config.dataset}_{config.partitioner}_seed{config.seed}"
    )
    folder = (results_root(config) / name).resolve()
    folder.mkdir(parents=True, exist_ok=bool(config.run_name))
    for stale in ("metrics.jsonl", "checkpoint.pt", "tracking.json", *(p.name for p in folder.glob("events.out.*"))):
        (folder / stale).unlink(missing_ok=True)  # a reused run-name starts afresh
    return folder


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


def _client_values(records: list[RecordDict], key: str) -> dict[str, float]:
    """``partition-id`` → value of ``key`` for every reply that reports both."""
    values = {}
    for record in records:
        metrics = next(iter(record.metric_records.values()))
        if "partition-id" in metrics and key in metrics:
            values[str(int(metrics["partition-id"]))] = float(metrics[key])
    return dict(sorted(values.items(), key=lambda item: int(item[0])))


# --- where clients ran ---

GLOBAL_NODE = "ray._private.worker._global_node"
"""Ray's node of this driver process: its ``head`` says whether this process started it."""
RAY_NODE_RECORD = "ray-node"
"""The ConfigRecord of a training reply that says on which Ray node the client ran (``node-id``, ``address``)."""


def ray_placement() -> dict[str, str] | None:
    """The Ray node this code runs on (``node-id``, ``address``) when it runs in a Ray worker, else None. Ray is
    not imported here: a process that has not loaded it is not a Ray worker."""
    ray: Any = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None and context.worker.mode != ray.WORKER_MODE:
        return None
    return {"node-id": context.get_node_id(), "address": ray.util.get_node_ip_address()}


def where_this_runs() -> str:
    """`` on Ray node <id> (<address>)`` inside a Ray worker, else an empty string: for error messages."""
    placement = ray_placement()
    return f" on Ray node {placement['node-id']} ({placement['address']})" if placement else ""


def joined_ray_cluster() -> bool:
    """Whether this process is a Ray driver that joined a running cluster (not a Ray it started itself, whose
    one node says nothing worth recording). Ray is not imported here."""
    ray: Any = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    if not seam.usable("the Ray node each client trained on is not recorded", GLOBAL_NODE):
        return False
    node = seam.get(GLOBAL_NODE)
    return node is not None and not node.head


def _ray_nodes(records: list[RecordDict]) -> dict[str, dict[str, str]]:
    """``partition-id`` → the Ray node (``node-id``, ``address``) each reply says it trained on (none outside Ray).
    Recorded only on a cluster the simulation joined: a Ray of the run's own has one node, with a new id each
    run."""
    nodes = {}
    for record in records:
        metrics = next(iter(record.metric_records.values()))
        if RAY_NODE_RECORD in record.config_records and "partition-id" in metrics:
            nodes[str(int(metrics["partition-id"]))] = {
                key: str(value) for key, value in record.config_records[RAY_NODE_RECORD].items()
            }
    return dict(sorted(nodes.items(), key=lambda item: int(item[0])))


def _unweighted_means(records: list[RecordDict], skip: set[str]) -> dict[str, Any]:
    """Every other metric averaged over clients with equal weight (lists element-wise): the paper's
    "mean over clients" for whatever an algorithm's evaluate hook reports."""
    columns: dict[str, list[Any]] = {}
    for record in records:
        for key, value in next(iter(record.metric_records.values())).items():
            if key not in skip:
                columns.setdefault(key, []).append(value)
    means: dict[str, Any] = {}
    for key, values in columns.items():
        if len(values) == len(records):  # reported by every client
            if isinstance(values[0], list):
                means[f"{key}-mean"] = [sum(column) / len(column) for column in zip(*values, strict=True)]
            else:
                means[f"{key}-mean"] = sum(float(v) for v in values) / len(values)
    return means


def _new_client_scores(records: list[RecordDict]) -> dict[str, Any]:
    """Held-out clients' scores of the global model (their ``local-*``), averaged with equal weight."""
    means = _unweighted_means(records, set())
    scores = {f"new-client-{key}": means.get(f"local-{key}-mean", math.nan) for key in ("accuracy", "ece", "mce")}
    return {**scores, "new-clients-evaluated": len(records)}


def _client_mean(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Example-weighted mean of the clients' metrics (lists element-wise), summed in the order given as Flower's
    FedAvg sums them; the weight itself and a client's id are not quantities to average."""
    weights = [float(next(iter(record.metric_records.values()))[weight_key]) for record in records]
    total = sum(weights)
    sums: dict[str, Any] = {}
    for record, weight in zip(records, weights, strict=True):
        factor = weight / total
        for metrics in record.metric_records.values():
            for key, value in metrics.items():
                if key in (weight_key, "partition-id", NEW_CLIENT):
                    continue
                term = [v * factor for v in value] if isinstance(value, list) else value * factor
                if key not in sums:
                    sums[key] = term
                elif isinstance(term, list):
                    sums[key] = [s + v for s, v in zip(sums[key], term, strict=True)]
                else:
                    sums[key] = sums[key] + term
    return MetricRecord(sums)


def _layer_divergence(records: list[RecordDict], weight_key: str) -> dict[str, float]:
    """Per layer, the example-weighted mean over this round's clients of ‖W_k − mean W‖² (PANs paper)."""
    states = [record[MODEL_RECORD].to_torch_state_dict() for record in records]
    weights = [float(next(iter(record.metric_records.values()))[weight_key]) for record in records]
    return divergence_by_layer(weight_divergence(states, weights))


@dataclass
class RoundRecorder:
    """Collects each round's client and server metrics and writes them as one JSON line.

    The round runner calls, per round: the train aggregation, the evaluate aggregation, then
    ``evaluate``, which scores the global model on the test split when the round is due one (round 0, every
    ``server_evaluate_every`` rounds and the last, ``num_server_rounds``) and writes the line.
    """

    folder: Path
    evaluate_global: GlobalEvaluation
    log_divergence: bool = False
    server_evaluate_every: int = 1
    num_server_rounds: int = 0
    progress: Callable[[int, float], str] | None = None
    score_clients: Callable[[list[ArrayRecord]], dict[str, float]] | None = None
    """The clients' trained models of a round → the server's scores of them (``server-ensemble``)."""
    units_moved: Callable[[ArrayRecord | None, list[ArrayRecord]], dict[str, dict[str, float]]] | None = None
    """The model a round started from (None when the clients did not) and the clients' trained models (partition
    order) → the round's units-moved entries (``log-units-moved``, :func:`units_moved_row`)."""
    independent_starts: bool = False
    """Whether round 1's clients start from their own models (``client-init=independent``): no units moved from
    the initial global model then."""
    round_start: ArrayRecord | None = None
    """The global model the current round started from (the last one :meth:`evaluate` saw), when the clients
    started from it."""
    """Round, elapsed seconds → the progress part of the round's log line
    (:class:`alignfl.fl_app.progress.RoundProgress`)."""
    started: float = field(default_factory=time.time)
    rows: list[dict[str, Any]] = field(default_factory=list)
    _pending: dict[str, Any] = field(default_factory=dict)
    extra_keys: dict[str, None] = field(default_factory=dict)
    """Ordered set of the clients' other evaluate metrics (``<key>-mean``, ``new-client-*``), repeated in the
    summary."""

    def aggregate_train(self, records: list[RecordDict], weight_key: str) -> MetricRecord:
        aggregated = _client_mean(records, weight_key)
        self._pending.update({"clients-trained": len(records), **aggregated})
        placements = _ray_nodes(records) if joined_ray_cluster() else {}
        if placements:
            self._pending["client-ray-nodes"] = placements
        if self.log_divergence:
            self._pending["weight-divergence"] = _layer_divergence(records, weight_key)
        if self.units_moved is not None:
            self._pending.update(self.units_moved(self.round_start, [record[MODEL_RECORD] for record in records]))
        if self.score_clients is not None:
            scores = self.score_clients([record[MODEL_RECORD] for record in records])
            self.extra_keys.update(dict.fromkeys(scores))
            self._pending.update(scores)
        return aggregated

    def aggregate_evaluate(self, records: list[RecordDict], weight_key: str) -> MetricRecord:
        """Clients with an empty local test split (tiny Dirichlet partitions) are left out of the means;
        held-out clients (``new-client``) are averaged on their own, as ``new-client-*``."""
        scored = [r for r in records if next(iter(r.metric_records.values()))[weight_key] > 0]
        is_new = [bool(next(iter(r.metric_records.values())).get(NEW_CLIENT)) for r in scored]
        new = [r for r, flag in zip(scored, is_new) if flag]
        scored = [r for r, flag in zip(scored, is_new) if not flag]
        if new:
            scores = _new_client_scores(new)
            self.extra_keys.update(dict.fromkeys(scores))
            self._pending.update(scores)
        aggregated = _client_mean(scored, weight_key) if scored else MetricRecord()
        per_client = _client_values(scored, "local-accuracy")
        extra = _unweighted_means(scored, {weight_key, "partition-id", NEW_CLIENT, "local-accuracy", "local-loss"})
        self.extra_keys.update(dict.fromkeys(extra))
        self._pending.update(
            {
                **extra,
                "clients-evaluated": len(scored),
                "local-accuracy-weighted": float(aggregated.get("local-accuracy", math.nan)),
                "local-accuracy-mean": sum(per_client.values()) / len(per_client) if per_client else math.nan,
                "local-accuracy-per-client": per_client,
            }
        )
        return aggregated

    def server_evaluates(self, server_round: int) -> bool:
        """Whether the server scores the global model after ``server_round`` (0: the initial model)."""
        return server_round % self.server_evaluate_every == 0 or server_round == self.num_server_rounds

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower's ``evaluate_fn``: score the global model when the round is due one, then write the round's
        line; returns the server's scores (none in a round without)."""
        scores: dict[str, float] = {}
        if self.server_evaluates(server_round):
            scores = dict(zip(("loss", "accuracy"), self.evaluate_global(arrays), strict=True))
        row = {"round": server_round, **scores, "elapsed-s": time.time() - self.started, **self._pending}
        self._pending = {}
        self.round_start = None if server_round == 0 and self.independent_starts else arrays
        self.rows.append(row)
        with (self.folder / "metrics.jsonl").open("a") as stream:
            stream.write(json.dumps(row, sort_keys=True) + "\n")
        local = row.get("local-accuracy-mean")
        new = row.get("new-client-accuracy")
        log(
            INFO,
            "[alignfl] round %d: %s%s%s%s",
            server_round,
            f"global accuracy {scores['accuracy']:.4f}, loss {scores['loss']:.4f}"
            if scores
            else f"the server did not evaluate the global model (server-evaluate-every {self.server_evaluate_every})",
            f", clients' local accuracy {local:.4f}" if local is not None else "",
            f", new clients' accuracy {new:.4f}" if new is not None else "",
            f" | {self.progress(server_round, row['elapsed-s'])}" if self.progress is not None else "",
        )
        return MetricRecord(scores)

    def record_participation(self, server_round: int, participation: Participation) -> None:
        """Who was sampled, aggregated and dropped, for this round's line."""
        self._pending.update(participation.metrics())

    def record_round(self, server_round: int, metrics: dict[str, Any]) -> None:
        """What the strategy reports of its own round (e.g. how many units a matching moved)."""
        self._pending.update(metrics)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the recorder: the rows so far, the extra keys, the elapsed time, and what the
        round being run has recorded so far (a checkpoint between a round's merge and its REPAIR query)."""
        return {
            "rows": list(self.rows),
            "extra-keys": list(self.extra_keys),
            "elapsed-s": time.time() - self.started,
            "pending": dict(self._pending),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`: ``metrics.jsonl`` is rewritten to hold exactly the checkpoint's rows
        (a round written after the last checkpoint is dropped, to be run again), and the clock goes on."""
        self.rows = list(state["rows"])
        self.extra_keys = dict.fromkeys(state["extra-keys"])
        self.started = time.time() - float(state["elapsed-s"])
        self._pending = dict(state.get("pending", {}))
        staged = self.folder / "metrics.jsonl.tmp"
        staged.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows))
        staged.replace(self.folder / "metrics.jsonl")

    def summary(self) -> dict[str, Any]:
        """Final and best global accuracy, mean and best of the last 5 rounds the server evaluated (accuracy
        zig-zags), wall time, how many clients' updates each round aggregated (rounds 1, 2, ...), and each cause a
        client's update was dropped for with how often (a node lost, or lacking the data, shows here;
        :func:`drop_cause`: the reasons' particulars masked, which ``metrics.jsonl`` keeps). The final scores are
        the last evaluated round's: the last round, which the server always evaluates."""
        trained = [r for r in self.rows if r["round"] > 0] or self.rows
        last = trained[-1]
        scored = [r for r in trained if "accuracy" in r] or [r for r in self.rows if "accuracy" in r]
        best = max(scored, key=lambda r: r["accuracy"])
        tail = [r["accuracy"] for r in scored[-5:]]
        return {
            "rounds": last["round"],
            "final-accuracy": scored[-1]["accuracy"],
            "final-loss": scored[-1]["loss"],
            "final-local-accuracy-mean": last.get("local-accuracy-mean"),
            "best-accuracy": best["accuracy"],
            "best-round": best["round"],
            "last-5-mean-accuracy": sum(tail) / len(tail),
            "last-5-best-accuracy": max(tail),
            "wall-time-s": time.time() - self.started,
            "clients-per-round": [r.get("clients-trained", 0) for r in self.rows if r["round"] > 0],
            "dropped-reasons": dict(
                Counter(
                    drop_cause(reason) for r in self.rows for reason in r.get("clients-dropped-reasons", {}).values()
                )
            ),
            **{f"final-{key}": last.get(key) for key in self.extra_keys},
            **self._units_moved_summary(),
        }

    def _units_moved_summary(self) -> dict[str, float]:
        """With ``log-units-moved``: the share of units moved from the rounds' start and between the clients,
        each averaged over groups and rounds."""
        summary = {}
        for key in (MOVED_FROM_START, MOVED_BETWEEN):
            shares = [sum(moved.values()) / len(moved) for r in self.rows if (moved := r.get(key))]
            if shares:
                summary[f"{key}-mean"] = sum(shares) / len(shares)
        return summary


def plot_accuracy(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy versus round: the global model on the test split (the rounds the server evaluated) and the
    clients' local mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    scored = [(r["round"], r["accuracy"]) for r in rows if "accuracy" in r]
    ax.plot(*zip(*scored), marker="o", label="global model, test split")
    local = [(r["round"], r["local-accuracy-mean"]) for r in rows if "local-accuracy-mean" in r]
    if local:
        ax.plot(*zip(*local), marker="s", label="clients' local test splits (mean)")
    ax.set(xlabel="round", ylabel="accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alignment(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per permutation group, the share of units each round's matching moved and the global width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matched = [r for r in rows if r.get("units-moved")]
    fig, (moved, width) = plt.subplots(1, 2, figsize=(10, 4))
    for group in matched[0]["units-moved"]:
        points = [(r["round"], r["units-moved"][group]) for r in matched if group in r["units-moved"]]
        moved.plot(*zip(*points), marker="o", label=group)
        sized = [(r["round"], r["global-width"][group]) for r in matched if group in r.get("global-width", {})]
        if sized:
            width.plot(*zip(*sized), marker="o", label=group)
    moved.set(xlabel="round", ylabel="share of units moved", title=title)
    width.set(xlabel="round", ylabel="global width (units)", title="global width per layer")
    for ax in (moved, width):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish_run(folder: Path, recorder: RoundRecorder, final_arrays: ArrayRecord, title: str) -> dict[str, Any]:
    """Write summary.json (with the project's commit and the machine), the plots and the final global model; return
    the summary."""
    summary = {**recorder.summary(), "run-folder": str(folder), "git-commit": git_commit(), "machine": machine()}
    write_json(folder / "summary.json", summary)
    plot_accuracy(recorder.rows, folder / "accuracy.png", title)
    if any(row.get("units-moved") for row in recorder.rows):
        plot_alignment(recorder.rows, folder / "alignment.png", title)
    torch.save(final_arrays.to_torch_state_dict(), folder / "model.pt")
    return summary
