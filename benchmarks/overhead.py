"""Framework overhead: one FedAvg experiment through alignfl's Flower simulation (or ``--engine batched``) and as
a plain PyTorch loop.

Both sides do the same work per round on the same data: the same partitions (``partition_dataset``),
the same local train/test splits (``client_split``), the same mini-batches in the same order
(``round_generator`` + ``iterate_batches``), the same initial model (seeded as the ServerApp seeds it),
example-weighted averaging, then the same evaluation: every client scores the new global model on its
local test split (``classification_scores``: accuracy, ECE, MCE, loss) and the server scores it on the
official test split (``evaluate``). The simulation also writes its run folder and a checkpoint every
round; that, serialization, Ray and message passing are the overhead measured.

Runs alternate (simulation, plain, simulation, plain, ...) in one process. A round's time is taken
after its server evaluation (the simulation's ``elapsed-s`` stamps; the same points in the plain loop);
round 1 holds the start-up (Ray actors loading data), so the medians are over rounds 2 and later.
Beside wall time, each round's CPU seconds are taken: of the driver for the plain loop, of the whole
process tree (driver, Ray's GCS, raylet and workers) for the simulation. On a machine shared with
other work, wall time depends on how the scheduler splits the cores among processes; CPU seconds
count the work done.
Ray gets ``--ray-cpus`` CPUs (default 1: clients train one at a time, as in the plain loop, so both
sides use the same compute).

    flock /tmp/alignfl-exp.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --pairs 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --clients 200 --engine batched --tracking none
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from benchutil import (
    RoundCounter,
    TreeSampler,
    append_jsonl,
    machine,
    median,
    read_jsonl,
    round_seconds,
    run_metrics,
    simulate,
    write_report,
)
from torch import nn

from alignfl.core.data import load_dataset
from alignfl.core.metrics.calibration import classification_scores
from alignfl.core.model_io import build_run_model, federated_state
from alignfl.core.partitioning.partitions import client_split, partition_dataset
from alignfl.core.training.sgd import evaluate, iterate_batches, round_generator, seed_everything, seed_torch
from alignfl.fl_app.config import RunConfig, parse_run_config
from alignfl.fl_app.engines.batched import run_batched

EXPERIMENT = {
    "strategy": "fedavg",
    "model": "mlp",
    "dataset": "fashion-mnist",
    "local-epochs": 1,
    "batch-size": 64,
    "num-server-rounds": 5,
    "seed": 0,
}


def client_tensors(config: RunConfig, num_clients: int) -> list[tuple[torch.Tensor, ...]]:
    """Each client's (train x, train y, test x, test y), sliced exactly as the ClientApp slices them."""
    dataset = load_dataset(config.dataset)
    parts = partition_dataset(
        config.dataset, None, config.partitioner, num_clients, config.seed, **config.partition_options()
    )
    tensors = []
    for pid, part in enumerate(parts):
        train, test = client_split(part, config.test_fraction, config.seed, pid)
        tensors.append((dataset.train_x[train], dataset.train_y[train], dataset.train_x[test], dataset.train_y[test]))
    return tensors


def local_sgd(
    model: nn.Module, config: RunConfig, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
) -> None:
    """FedAvg's local update written out: SGD on cross-entropy, the ClientApp's batches."""
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    model.train()
    for _ in range(config.local_epochs):
        for xb, yb in iterate_batches(x, y, config.batch_size, generator):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()


def plain_fedavg(config: RunConfig, num_clients: int) -> list[dict[str, Any]]:
    """The experiment without Flower; one row per round (its seconds and the global model's scores)."""
    dataset = load_dataset(config.dataset)
    clients = client_tensors(config, num_clients)
    seed_everything(config.seed)  # as the ServerApp does before building the model: the same initial weights
    model = build_run_model(config, dataset)
    global_state = {k: v.clone() for k, v in federated_state(model).items()}
    device = torch.device("cpu")
    rows, started, cpu_started = [], time.time(), time.process_time()
    for server_round in range(1, config.num_server_rounds + 1):
        total = sum(len(train_y) for _, train_y, _, _ in clients)
        summed = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for pid, (train_x, train_y, _, _) in enumerate(clients):
            model.load_state_dict(global_state, strict=False)
            generator = round_generator(config.seed, server_round, pid)
            seed_torch(int(torch.randint(0, 2**62, (1,), generator=generator)), device)  # as a client seeds
            local_sgd(model, config, train_x, train_y, generator)
            for key, value in federated_state(model).items():
                summed[key] += value * (len(train_y) / total)
        global_state = summed
        model.load_state_dict(global_state, strict=False)
        local = [classification_scores(model, test_x, test_y, device) for _, _, test_x, test_y in clients]
        loss, accuracy = evaluate(model, dataset.test_x, dataset.test_y, device)
        now, cpu_now = time.time(), time.process_time()
        rows.append(
            {
                "round": server_round,
                "seconds": now - started,
                "cpu-seconds": cpu_now - cpu_started,
                "accuracy": accuracy,
                "loss": loss,
                "local-accuracy-mean": sum(score[0] for score in local if not math.isnan(score[0])) / len(local),
            }
        )
        started, cpu_started = now, cpu_now
    return rows


def simulated_fedavg(
    config: RunConfig, num_clients: int, ray_cpus: int, results_dir: Path, run_name: str, engine: str = "ray"
) -> list[dict[str, Any]]:
    """The experiment through the product's apps on ``engine`` (``ray``: Flower's Ray simulation; ``batched``:
    the batched engine, one worker in this process, clients one after another); one row per round from its
    metrics.jsonl."""
    settings = {
        **config.to_run_config(),
        "results-dir": str(results_dir),
        "run-name": run_name,
        "min-available-nodes": num_clients,
    }
    import ray  # noqa: F401  (puts the psutil Ray ships on sys.path, for the sampler)

    sampler = TreeSampler(interval=0.25, tag=RoundCounter(results_dir / run_name / "metrics.jsonl"), memory=False)
    with sampler:
        if engine == "batched":
            run_batched(settings, num_clients, "off")
        else:
            simulate(settings, num_clients, ray_cpus)
    cpu_at = sampler.first_per_tag("cpu-s")  # CPU seconds of the process tree when each round began
    metrics = sorted(run_metrics(results_dir, run_name), key=lambda row: row["round"])
    return [
        {
            "round": row["round"],
            "seconds": seconds,
            "accuracy": row["accuracy"],
            "loss": row["loss"],
            "cpu-seconds": cpu_at.get(row["round"] + 1, math.nan) - cpu_at.get(row["round"], math.nan),
            "local-accuracy-mean": row.get("local-accuracy-mean"),
        }
        for row, seconds in zip(metrics[1:], round_seconds(metrics))
    ]


def steady(rows: list[dict[str, Any]], side: str, key: str = "seconds") -> list[float]:
    """Wall (or CPU) seconds of one side's rounds after each run's first round."""
    return [
        round_row[key] for row in rows if row["side"] == side for round_row in row["rounds"] if round_row["round"] > 1
    ]


def report(rows: list[dict[str, Any]]) -> str:
    """A Markdown summary: per-run medians, pooled medians and the ratio."""
    lines = [
        "| run | side | rounds 2+ median wall (s) | rounds 2+ median CPU (s) | round 1 wall (s) | "
        "final accuracy | load average (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(rows):
        later = [r["seconds"] for r in row["rounds"] if r["round"] > 1]
        first = row["rounds"][0]["seconds"] if row["rounds"] else math.nan
        final = row["rounds"][-1]["accuracy"] if row["rounds"] else math.nan
        cpu = [r["cpu-seconds"] for r in row["rounds"] if r["round"] > 1]
        lines.append(
            f"| {index} | {row['side']}{f' ({engine})' if (engine := row.get('engine')) else ''} | {median(later):.2f} | {median(cpu):.2f} | {first:.2f} | "
            f"{final:.4f} | {row['load-after'][0]:.2f} |"
        )
    for key, label in (("seconds", "wall"), ("cpu-seconds", "CPU (whole process tree)")):
        simulation, plain = median(steady(rows, "simulation", key)), median(steady(rows, "plain", key))
        lines += [
            "",
            f"median {label} seconds per round after round 1: simulation {simulation:.2f}, "
            f"plain PyTorch {plain:.2f}, ratio {simulation / plain:.3f} (target <= 1.05)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="simulation/plain pairs, alternated (default 3)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dataset", default="fashion-mnist", help="fashion-mnist (the benchmark) or digits (a smoke test)"
    )
    parser.add_argument("--ray-cpus", type=int, default=1, help="CPUs Ray may use (default 1: one client at a time)")
    parser.add_argument(
        "--engine",
        default="ray",
        choices=("ray", "batched"),
        help="the simulation side: Flower's Ray simulation (default) or the batched engine (sim.backend=batched)",
    )
    parser.add_argument(
        "--tracking",
        default="tensorboard",
        choices=("tensorboard", "none"),
        help="the simulation's run-config key tracking (default: the default, TensorBoard on)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for rows.jsonl and report.md (default: a new one under ~/alignfl-results); "
        "an existing folder is resumed: its finished runs count and are not run again",
    )
    args = parser.parse_args(argv)
    for name in ("pairs", "clients", "rounds", "ray_cpus"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    torch.set_num_threads(1)
    config = parse_run_config(
        {**EXPERIMENT, "num-server-rounds": args.rounds, "dataset": args.dataset, "tracking": args.tracking}
    )
    out = (
        args.out or Path.home() / "alignfl-results" / "benchmarks" / f"overhead-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    print(f"[overhead] {machine()}; results in {out}", flush=True)
    done = read_jsonl(rows_path)
    for index in range(len(done), 2 * args.pairs):
        side = ("simulation", "plain")[index % 2]
        load_before = list(os.getloadavg())
        if side == "simulation":
            with tempfile.TemporaryDirectory(prefix="alignfl-overhead-") as tmp:
                rounds = simulated_fedavg(config, args.clients, args.ray_cpus, Path(tmp), "run", args.engine)
        else:
            rounds = plain_fedavg(config, args.clients)
        row = {
            "side": side,
            "rounds": rounds,
            "load-before": load_before,
            "load-after": list(os.getloadavg()),
            "machine": machine(),
            "ray-cpus": args.ray_cpus,
            "engine": args.engine if side == "simulation" else None,
        }
        append_jsonl(rows_path, row)
        print(
            f"[overhead] run {index} ({side}): "
            + ", ".join(f"r{r['round']} {r['seconds']:.2f}s acc {r['accuracy']:.4f}" for r in rounds),
            flush=True,
        )
    return write_report(out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
