"""One-shot merging of K independently initialised clients: average, matched, BBP-MAP, OT exact, OT Sinkhorn,
the ensemble and the best client, for K = 2, 4, 8, 16.

Each client trains as round 1 of a one-shot run (``num-server-rounds=1``, ``client-init=independent``) trains it:
:func:`alignfl.fl_app.analysis.merge.train_clients`, which a test pins equal to the ServerApp's one-shot runs. Settings
are the drift study's (``conf/experiment/drift.yaml``): Fashion-MNIST, a fixed 3,200-image subset split by
Dirichlet(alpha), E = 20, batch 32, lr 0.01, momentum 0.9.

    python benchmarks/one_shot.py --network mlp --seeds 0 1 2 --out benchmarks/runs/one_shot_mlp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord

from alignfl.core.metrics.ensemble import score_models
from alignfl.core.model_io import build_run_model, load_arrays
from alignfl.core.training.sgd import evaluate
from alignfl.fl_app.analysis.merge import merge_accuracies, strategy_merge, train_clients
from alignfl.fl_app.config import RunConfig, parse_run_config

NETWORKS = {
    "mlp": {"model": "small-mlp"},
    "vgg": {"model": "vgg9", "width-factor": 0.125, "init": "he"},
}
COLUMNS = ("average", "matched-weight", "matched-bbp", "matched-ot", "ot-sinkhorn", "ensemble", "best-client")


def run_config(network: str, seed: int, epochs: int, alpha: float, train_size: int) -> RunConfig:
    """The one-shot clients' settings (module notes), shared with ``many_models.py``."""
    return parse_run_config(
        {
            **NETWORKS[network],
            "dataset": "fashion-mnist",
            "device": "cpu",
            "seed": seed,
            "local-epochs": epochs,
            "batch-size": 32,
            "lr": 0.01,
            "momentum": 0.9,
            "weight-decay": 0.0,
            "train-size": train_size,
            "dirichlet-alpha": alpha,
            "client-init": "independent",
        }
    )


def one_cell(network: str, clients: int, seed: int, epochs: int, alpha: float, train_size: int) -> dict:
    """Train ``clients`` models and score every merge of them on the test split."""
    config = run_config(network, seed, epochs, alpha, train_size)
    device = torch.device("cpu")
    started = time.perf_counter()
    states, counts, dataset, classes = train_clients(config, clients, same_init=False, device=device)
    trained = time.perf_counter()
    model = build_run_model(config, dataset)
    singles, merged, _ = merge_accuracies(
        config, model, states, counts, dataset.test_x, dataset.test_y, ("weight", "bbp", "ot"), 1, device, classes
    )
    sinkhorn = strategy_merge(config, model, "otfusion", {"otfusion-exact": False}, states, counts, states[0])
    load_arrays(model, sinkhorn.arrays)
    merged["ot-sinkhorn"] = evaluate(model, dataset.test_x, dataset.test_y, device)[1]
    merged["best-client"] = max(singles)
    ensemble = score_models(model, [ArrayRecord(s) for s in states], dataset.test_x, dataset.test_y, device)
    assert abs(ensemble.ensemble - merged["ensemble"]) < 1e-9
    return {
        "network": network,
        "clients": clients,
        "seed": seed,
        "accuracy": merged,
        "train-s": trained - started,
        "merge-s": time.perf_counter() - trained,
    }


def add_cell_arguments(parser: argparse.ArgumentParser) -> None:
    """The cells' options (network, K, seeds and the clients' training), shared with ``many_models.py``."""
    parser.add_argument("--network", choices=sorted(NETWORKS), default="mlp")
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--train-size", type=int, default=3200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cells = []
    for clients in args.clients:
        for seed in args.seeds:
            cell = one_cell(args.network, clients, seed, args.epochs, args.alpha, args.train_size)
            cells.append(cell)
            print(json.dumps(cell), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cells": cells}, indent=1))
    print(f"\n{args.network}, E = {args.epochs}, alpha = {args.alpha}: mean test accuracy % over seeds {args.seeds}")
    print("| K | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for clients in args.clients:
        mine = [c["accuracy"] for c in cells if c["clients"] == clients]
        means = [100 * statistics.fmean(m[column] for m in mine) for column in COLUMNS]
        print(f"| {clients} | " + " | ".join(f"{v:.1f}" for v in means) + " |")


if __name__ == "__main__":
    main()
