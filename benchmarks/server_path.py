"""CPU seconds of each step of the ServerApp's per-round path, for the default experiment's 10 replies.

The steps the ServerApp adds to a round besides the clients' work and the server's evaluation (which the plain
loop of ``overhead.py`` does too): the reply checks, Flower's weighted mean (against the same mean in torch, as
the plain loop computes it), the checkpoint (CPU and wall: it is flushed to disk), and the tracking of one
round's metrics row. CPU time (``time.process_time``, median of repeats) is what counts on a loaded machine.

    .venv/bin/python benchmarks/server_path.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from alignfl.core.model_io import build_model_for, to_arrays
from alignfl.core.rounds.replies import METRICS_RECORD, MODEL_RECORD, NUM_EXAMPLES, arrays_problem
from alignfl.core.rounds.strategy import Reply, weighted_mean
from alignfl.fl_app.checkpoint import Checkpoint, save_checkpoint
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.tracking import Tracking


def cpu_seconds(step: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        step()
        times.append(time.process_time() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = parse_run_config({"dataset": "fashion-mnist", "device": "cpu"})  # the default run: MLP, TensorBoard
    model = build_model_for(config, (1, 28, 28), 10)
    reference = to_arrays(model)
    weights = [100.0 + index for index in range(args.clients)]
    replies = [
        Reply(
            index,
            index,
            RecordDict({MODEL_RECORD: to_arrays(model), METRICS_RECORD: MetricRecord({NUM_EXAMPLES: weight})}),
            weight,
        )
        for index, weight in enumerate(weights)
    ]

    def torch_mean() -> ArrayRecord:
        states = [reply.arrays.to_torch_state_dict() for reply in replies]
        total = sum(weights)
        return ArrayRecord(
            {key: sum(state[key] * (w / total) for state, w in zip(states, weights)) for key in states[0]}
        )

    folder = Path(tempfile.mkdtemp(prefix="alignfl-server-path-"))
    rows = [{"round": r, "accuracy": 0.8, "loss": 0.5} for r in range(10)]
    checkpoint = Checkpoint(
        3, config.to_run_config(), reference, {}, {"rows": rows, "extra-keys": [], "elapsed-s": 1.0}, random.getstate()
    )
    tracking = Tracking.open(config, folder, resumed=False)
    row = {
        "accuracy": 0.8,
        "loss": 0.5,
        "elapsed-s": 12.0,
        "clients-sampled": 10,
        "clients-trained": 10,
        "clients-dropped": 0,
        "train-loss": 0.4,
        "clients-evaluated": 10,
        "local-accuracy-mean": 0.8,
        "local-accuracy-weighted": 0.8,
        "local-ece-mean": 0.05,
        "local-mce-mean": 0.2,
        "local-accuracy-per-client": {str(i): 0.8 for i in range(args.clients)},
    }
    tracked: list[dict[str, Any]] = []

    def track() -> None:
        tracked.append({**row, "round": len(tracked)})
        tracking.log_rows(tracked)

    print(
        f"MLP, {sum(p.numel() for p in model.parameters()):,} parameters, {args.clients} replies; "
        f"CPU seconds, median of {args.repeats}"
    )
    steps = {
        "reply checks (keys, shapes, finite):  ": lambda: [arrays_problem(r.arrays, reference) for r in replies],
        "weighted mean (Flower's arithmetic):  ": lambda: weighted_mean(replies),
        "  the same mean in torch (plain loop):": torch_mean,
        "checkpoint (torch.save, fsync):       ": lambda: save_checkpoint(folder, checkpoint),
    }
    for label, step in steps.items():
        print(f"{label} {cpu_seconds(step, args.repeats):.4f}")
    started = time.perf_counter()
    save_checkpoint(folder, checkpoint)
    print(f"  its wall time (disk):                {time.perf_counter() - started:.4f}")
    print(f"tracking one row (TensorBoard):        {cpu_seconds(track, args.repeats):.4f}")
    tracking.close(failed=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
