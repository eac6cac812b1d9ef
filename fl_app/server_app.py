"""The ServerApp: validates the run config, then runs the chosen strategy with server-side evaluation."""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fl_app.config import RunConfig, parse_run_config
from fl_app.data import check_dataset_available, load_dataset
from fl_app.model_io import build_run_model, load_arrays, to_arrays
from fl_app.results import RoundRecorder, finish_run, make_run_folder, write_json
from fl_app.training import evaluate, seed_everything, select_device
from strategies import get_strategy
from strategies.base import MetricAggregation


def wait_for_nodes(grid: Grid, count: int) -> None:
    """Block until ``count`` nodes are connected: Flower sizes each round's sample from the nodes
    connected at that moment, so starting early would shrink the first rounds."""
    while (connected := len(list(grid.get_node_ids()))) < count:
        log(INFO, "[alignfl] waiting for nodes: %d connected, min-available-nodes=%d", connected, count)
        time.sleep(1.0)


def run_experiment(grid: Grid, config: RunConfig) -> dict[str, Any]:
    """Train for ``num-server-rounds`` and write the run folder; returns the summary."""
    root = config.data_root or None
    check_dataset_available(config.dataset, root)
    entry = get_strategy(config.strategy)
    seed_everything(config.seed)
    device = select_device(config.device)
    dataset = load_dataset(config.dataset, root)
    model = build_run_model(config, dataset).to(device)
    initial_arrays = to_arrays(model)

    folder = make_run_folder(config)
    write_json(folder / "config.json", config.to_run_config())
    log(INFO, "[alignfl] %s on %s (%s), run folder: %s", config.strategy, config.dataset, config.model, folder)

    def evaluate_global(arrays: ArrayRecord) -> tuple[float, float]:
        load_arrays(model, arrays)
        return evaluate(model, dataset.test_x, dataset.test_y, device)

    recorder = RoundRecorder(folder, evaluate_global, log_divergence=config.log_divergence)
    wait_for_nodes(grid, config.min_available_nodes)
    strategy = entry.build_server(config, MetricAggregation(recorder.aggregate_train, recorder.aggregate_evaluate))
    result = strategy.start(grid, initial_arrays, num_rounds=config.num_server_rounds,
                            train_config=ConfigRecord(config.pan_signature()),
                            evaluate_config=ConfigRecord(config.pan_signature()),
                            evaluate_fn=recorder.evaluate)
    if not len(result.arrays):
        raise RuntimeError(f"no round produced a usable client update; see the log and {folder / 'metrics.jsonl'}")
    final_arrays = result.arrays
    summary = finish_run(folder, recorder, final_arrays,
                         f"{config.strategy} · {config.model} · {config.dataset} ({config.partitioner})")
    log(INFO, "[alignfl] finished: final accuracy %.4f, best %.4f; results in %s",
        summary["final-accuracy"], summary["best-accuracy"], folder)
    return summary


def build_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """A ServerApp whose run config is ``context.run_config`` updated with ``overrides``."""
    overrides = dict(overrides or {})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_experiment(grid, parse_run_config({**context.run_config, **overrides}))

    return app


app = build_server_app()
