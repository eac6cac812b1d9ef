"""A run's checkpoint: everything the server needs to continue after its last complete round.

After every round the ServerApp writes ``checkpoint.pt`` into the
run folder: the round number, the run config, the global arrays, the strategy's
server state (:meth:`alignfl.core.rounds.strategy.ServerStrategy.state_dict`), the metrics rows so
far and the state of the round runner's client-sampling stream (so a resumed run samples
the clients the uninterrupted run would have). It is written to
a temporary file that then replaces the old one, so a crash leaves the previous
checkpoint whole.

With ``repair=on`` the server also checkpoints a training round between its merge and its REPAIR query
(:class:`alignfl.core.rounds.repair_round.PendingRepair`: the merged model and the clients' statistics on its units,
with the strategy, recorder and sampling state of that moment); the checkpoint's round is then the last complete one and
a resumed run asks that round's clients the query again instead of training the round again.

``resume-from=<run folder>`` loads it. State the clients keep in ``context.state``
(SCAFFOLD's c_i, MOON's previous model, SuPerFed's, FedPer's and Ditto's personal
models) lives on the nodes, not here: each node snapshots it after every round in its
own state folder and restores it when the run is resumed (:mod:`alignfl.fl_app.node_state`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from alignfl.core.config import RunConfig, results_root
from alignfl.core.rounds.repair_round import PendingRepair
from alignfl.core.rounds.runner import RoundRunner
from alignfl.fl_app.config import default_run_config, rename_old_keys
from alignfl.plugins.options import ConfigError

CHECKPOINT = "checkpoint.pt"
FORMAT = 1
RESUMABLE_CHANGES = frozenset(
    {
        "resume-from",
        "num-server-rounds",
        "round-timeout",
        "device",
        "min-available-nodes",
        "results-dir",
        "run-name",
        "data-root",
        "log-divergence",
        "server-evaluate-every",
        "node-wait-timeout",
        "tracking",
        "mlflow-uri",
    }
)
"""Run-config keys a resumed run may set differently: where and how long it runs, not what it computes
(``num-server-rounds`` may grow to extend a run; SuPerFed's mixing start, a fraction of it, moves then)."""


@dataclass(frozen=True)
class Checkpoint:
    """The server's state after round ``round``."""

    round: int
    config: dict[str, Any]
    arrays: ArrayRecord
    strategy_state: dict[str, Any]
    recorder_state: dict[str, Any]
    sampling_random: Any
    """:attr:`alignfl.core.rounds.runner.RoundRunner.sampling_state`: a ``random.getstate()`` tuple."""
    pending: PendingRepair | None = None
    """Round ``round + 1`` between its merge and its REPAIR query, or None (taken at a round's end)."""


def capture(
    server_round: int,
    config: RunConfig,
    arrays: ArrayRecord,
    runner: RoundRunner,
    recorder_state: dict[str, Any],
    pending: PendingRepair | None = None,
) -> Checkpoint:
    """A checkpoint of the server as it is now: after ``server_round`` (``arrays`` its global model), or in the
    next round between its merge and its REPAIR query (``pending``)."""
    return Checkpoint(
        server_round,
        config.to_run_config(),
        arrays,
        runner.strategy.state_dict(),
        recorder_state,
        runner.sampling_state,
        pending,
    )


def save_checkpoint(folder: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint.pt`` atomically: a temporary file, flushed to disk, then renamed over the old one."""
    payload = {
        "format": FORMAT,
        "round": checkpoint.round,
        "config": checkpoint.config,
        "arrays": checkpoint.arrays.to_torch_state_dict(),
        "strategy": checkpoint.strategy_state,
        "recorder": checkpoint.recorder_state,
        "sampling-random": checkpoint.sampling_random,
        "repair-pending": checkpoint.pending.state() if checkpoint.pending is not None else None,
    }
    path = folder / CHECKPOINT
    staged = folder / f"{CHECKPOINT}.tmp"
    with staged.open("wb") as stream:
        torch.save(payload, stream)
        stream.flush()
        os.fsync(stream.fileno())
    staged.replace(path)
    return path


def load_checkpoint(folder: Path) -> Checkpoint:
    """Read a run folder's checkpoint; refuses a missing folder or file, or one this version cannot read."""
    if not folder.is_dir():
        raise ConfigError(
            f"run-config key 'resume-from' = {str(folder)!r}: no such folder; give the folder of an earlier run"
        )
    path = folder / CHECKPOINT
    if not path.is_file():
        raise ConfigError(
            f"run-config key 'resume-from' = {str(folder)!r}: the folder holds no {CHECKPOINT} "
            "(a run writes one when it completes round 1)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file; torch's first line says which
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise ConfigError(
            f"run-config key 'resume-from' = {str(folder)!r}: {CHECKPOINT} cannot be read "
            f"({type(error).__name__}: {first})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ConfigError(
            f"run-config key 'resume-from' = {str(folder)!r}: {CHECKPOINT} is not a format-{FORMAT} alignfl checkpoint"
        )
    return Checkpoint(
        int(payload["round"]),
        rename_old_keys(payload["config"]),  # a checkpoint written before a key was renamed resumes
        ArrayRecord(dict(payload["arrays"])),
        dict(payload["strategy"]),
        dict(payload["recorder"]),
        _as_random_state(payload["sampling-random"]),
        PendingRepair.from_state(payload["repair-pending"]) if payload.get("repair-pending") is not None else None,
    )


def _as_random_state(state: Any) -> tuple[Any, ...]:
    """``random.setstate`` wants the nested tuples ``getstate`` gave (a round trip may turn them into lists)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def config_differences(saved: Mapping[str, Any], config: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Key → (checkpoint's value, this run's value) for every key that must not change on resume. A key on one
    side only is at its default on the other (a run stores only the keys of its own algorithm, model and
    partitioner; checkpoints from before partitioners had settings classes store every partitioner's key)."""
    current, defaults = config.to_run_config(), default_run_config()
    keys = (set(saved) | set(current)) - RESUMABLE_CHANGES
    values = {key: (saved.get(key, defaults.get(key)), current.get(key, defaults.get(key))) for key in sorted(keys)}
    return {key: (old, new) for key, (old, new) in values.items() if old != new}


def resume_checkpoint(config: RunConfig) -> Checkpoint:
    """The checkpoint of ``resume-from``, checked against this run's config before anything starts."""
    checkpoint = load_checkpoint(Path(config.resume_from))
    differences = config_differences(checkpoint.config, config)
    if differences:
        listed = ", ".join(f"'{key}': checkpoint {old!r}, now {new!r}" for key, (old, new) in differences.items())
        raise ConfigError(
            f"run-config key 'resume-from' = {config.resume_from!r}: the run config differs from the "
            f"checkpoint's in keys a resumed run must keep ({listed}); only "
            f"{sorted(RESUMABLE_CHANGES)} may change"
        )
    if checkpoint.round > config.num_server_rounds:
        raise ConfigError(
            f"run-config key 'num-server-rounds' = {config.num_server_rounds}: the run to resume has "
            f"already completed round {checkpoint.round}; set at least {checkpoint.round}"
        )
    return checkpoint


def run_folder(config: RunConfig) -> Path:
    """The run's folder: the one it resumes, or ``results-dir/run-name``."""
    return Path(config.resume_from) if config.resume_from else results_root(config) / config.run_name


def checkpointed_round(config: RunConfig) -> int | None:
    """The last round the run checkpointed, or None (no checkpoint, or not readable)."""
    if not (run_folder(config) / CHECKPOINT).is_file():
        return None
    try:
        return load_checkpoint(run_folder(config)).round
    except ConfigError:
        return None
