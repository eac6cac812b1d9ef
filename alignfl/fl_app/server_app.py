"""The ServerApp: validates the run config, builds the model and the algorithm's server side from it, then runs
the rounds with server-side evaluation (every ``server-evaluate-every`` rounds and in the last), checkpointing every
round (and resuming from a checkpoint with ``resume-from``)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import check_dataset_available, load_dataset
from alignfl.core.merging.drift import units_moved_row
from alignfl.core.metrics.ensemble import score_models
from alignfl.core.model_io import build_run_model, load_arrays
from alignfl.core.rounds.nodes import PartitionTable
from alignfl.core.rounds.repair_round import PendingRepair
from alignfl.core.rounds.runner import MetricAggregation, RoundRunner
from alignfl.core.training.sgd import evaluate, seed_everything, select_device
from alignfl.fl_app.checkpoint import Checkpoint, capture, resume_checkpoint, save_checkpoint
from alignfl.fl_app.config import ConfigError, build_context, parse_run_config
from alignfl.fl_app.patches.flower_runtime import prepare_simulation
from alignfl.fl_app.patches.object_pulls import retry_reply_pulls_sooner
from alignfl.fl_app.progress import RoundProgress
from alignfl.fl_app.results import RoundRecorder, finish_run, make_run_folder, write_json
from alignfl.fl_app.tracking import Tracking, check_tracking
from alignfl.strategies import get_strategy


def _run_folder(config: RunConfig, checkpoint: Checkpoint | None) -> Path:
    """A new run's fresh folder, or the folder of the run being resumed."""
    return Path(config.resume_from) if checkpoint is not None else make_run_folder(config)


def _initial_arrays(model: nn.Module, model_arrays: ArrayRecord, checkpoint: Checkpoint | None) -> ArrayRecord:
    """The model the first round starts from: the new model, or the checkpoint's global model if it fits (at
    the widths it grew to, for FedMA's matching)."""
    if checkpoint is None:
        return model_arrays
    try:
        load_arrays(model, checkpoint.arrays)
    except ValueError as error:
        raise ConfigError(
            f"run-config key 'resume-from': the checkpoint's global model does not fit this run's model: {error}"
        ) from None
    return checkpoint.arrays


def run_experiment(grid: Grid, config: RunConfig, partition_table: PartitionTable | None = None) -> dict[str, Any]:
    """Train rounds up to ``num-server-rounds`` (after the checkpoint's round when resuming), checkpoint
    every round and write the run folder; returns the summary. ``partition_table``: where the runtime knows
    which node holds which partition (see :class:`alignfl.core.rounds.nodes.NodeDirectory`)."""
    root = config.data_root or None
    check_tracking(config)
    check_dataset_available(config.dataset, root)
    checkpoint = resume_checkpoint(config) if config.resume_from else None
    seed_everything(config.seed)
    device = select_device(config.device)
    dataset = load_dataset(config.dataset, root)
    model = build_run_model(config, dataset).to(device)
    context = build_context(config, model)
    strategy = get_strategy(config.strategy).server(context)
    initial_arrays = _initial_arrays(model, context.initial_arrays, checkpoint)

    folder = _run_folder(config, checkpoint)
    write_json(folder / "config.json", config.to_run_config())
    log(
        INFO,
        "[alignfl] %s on %s (%s), run folder: %s%s",
        config.strategy,
        config.dataset,
        config.model,
        folder,
        f" (resumed after round {checkpoint.round})" if checkpoint is not None else "",
    )

    def evaluate_global(arrays: ArrayRecord) -> tuple[float, float]:
        load_arrays(model, arrays)
        return evaluate(model, dataset.test_x, dataset.test_y, device)

    def score_clients(models: list[ArrayRecord]) -> dict[str, float]:
        return score_models(model, models, dataset.test_x, dataset.test_y, device).metrics()

    first_round = checkpoint.round + 1 if checkpoint is not None else 1
    tracking = Tracking.open(config, folder, resumed=checkpoint is not None)  # before the clock starts
    failed = True
    try:
        recorder = RoundRecorder(
            folder,
            evaluate_global,
            log_divergence=config.log_divergence,
            server_evaluate_every=config.server_evaluate_every,
            num_server_rounds=config.num_server_rounds,
            progress=RoundProgress(config.num_server_rounds, first_round).describe,
            score_clients=score_clients if config.server_ensemble else None,
            units_moved=partial(units_moved_row, spec=context.spec) if config.log_units_moved else None,
            independent_starts=config.client_init == "independent",
            round_start=initial_arrays if checkpoint is not None else None,
        )
        runner = RoundRunner(
            strategy,
            grid,
            MetricAggregation(
                recorder.aggregate_train,
                recorder.aggregate_evaluate,
                recorder.record_participation,
                recorder.record_round,
            ),
            partition_table,
        )
        if checkpoint is not None:
            recorder.restore(checkpoint.recorder_state)
            strategy.load_state_dict(checkpoint.strategy_state)
            runner.sampling_state = checkpoint.sampling_random
        tracking.log_rows(recorder.rows)  # a resumed run's rounds the trackers may lack

        def end_round(server_round: int, arrays: ArrayRecord) -> None:
            save_checkpoint(folder, capture(server_round, config, arrays, runner, recorder.state()))
            tracking.log_rows(recorder.rows)  # once the round is durable, so a resumed run tracks it once

        def merged(server_round: int, start: ArrayRecord, pending: PendingRepair) -> None:
            save_checkpoint(folder, capture(server_round - 1, config, start, runner, recorder.state(), pending))

        runner.on_merged = merged
        final = runner.run(
            initial_arrays,
            first_round=first_round,
            evaluate_fn=recorder.evaluate,
            on_round_end=end_round,
            pending=checkpoint.pending if checkpoint is not None else None,
        )
        if not any(row.get("clients-trained") for row in recorder.rows if row["round"] > 0):
            raise RuntimeError(f"no round produced a usable client update; see the log and {folder / 'metrics.jsonl'}")
        summary = tracking.finish(
            finish_run(
                folder, recorder, final, f"{config.strategy} · {config.model} · {config.dataset} ({config.partitioner})"
            ),
            folder,
        )
        failed = False
    finally:
        tracking.close(failed)
    log(
        INFO,
        "[alignfl] finished: final accuracy %.4f, best %.4f; results in %s",
        summary["final-accuracy"],
        summary["best-accuracy"],
        folder,
    )
    return summary


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose run config is ``context.run_config`` updated with ``overrides``."""
    overrides = dict(overrides or {})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = parse_run_config({**context.run_config, **overrides})
        retry_reply_pulls_sooner()  # a deployed ServerApp pulls its replies' objects
        run_experiment(grid, config, prepare_simulation(grid))  # Flower's simulation prepared (None elsewhere)

    return app


app = build_server_app()
