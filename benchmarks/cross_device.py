"""The cross-device workload, engines side by side: many small clients, a few of them per round.

FedAvg on Fashion-MNIST split over ``--clients`` clients by a Dirichlet(0.3) prior, ``--per-round`` of them
train (batch 10, one local epoch) and as many score the global model on their local test split every 10th round
(``evaluate-every``) and in the last; the server scores it on the official test split as often
(``server-evaluate-every``: round 0, every 10th and the last), as cross-device studies do. Each model
(:data:`MODELS`) runs on every engine, one after another in this process:

* ``ray``: Flower's Ray simulation of the product's apps (what the launcher's ``flwr run`` runs), ``--ray-cpus``
  (the one engine that needs Ray: where it is not installed, ``--engines inprocess,batched,vectorised,plain``);
* ``inprocess``: ``sim.backend=inprocess``, one client after another;
* ``batched``: the batched engine, one worker in this process, clients one after another;
* ``vectorised``: the same, clients of a round trained as one stacked update (torch.func);
* ``plain``: a plain PyTorch loop doing the same work: the same sampled clients (the round runner's seeded
  sampling), partitions, splits, batches, initial model, weighted mean, client and server evaluations.

A round's time ends when its row is written, after the server's evaluation in a round that has one (the runs'
``elapsed-s`` stamps; the same point in the plain loop); round 1 holds start-up (Ray, data), so medians are over
rounds 2 and later. Accuracies, and their gaps to the plain loop, are of the rounds the server evaluated. CPU
seconds are of this process and its children (Ray's), sampled every 0.25 s (psutil, or the one Ray ships).
``device=auto``: CUDA where present (each worker one CUDA context, clients' data on the device).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cross_device.py              # the full workload
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cross_device.py --clients 200 --per-round 10 --rounds 4
    OMP_NUM_THREADS=1 python3 benchmarks/cross_device.py --engines inprocess,batched,vectorised,plain  # no Ray
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from benchutil import RoundCounter, TreeSampler, append_jsonl, machine, median, round_seconds, run_metrics, simulate
from torch import nn

from alignfl.core.metrics.calibration import classification_scores
from alignfl.core.model_io import build_run_model, federated_state
from alignfl.core.training.sgd import (
    evaluate,
    iterate_batches,
    round_generator,
    seed_everything,
    seed_torch,
    select_device,
)
from alignfl.fl_app.checkpoint import load_checkpoint
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import RunConfig, parse_run_config
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.inprocess import run_in_process

ENGINES = ("ray", "inprocess", "batched", "vectorised", "plain")
MODELS = ("twocnn", "twonn", "mlp")
"""FedAvg's CNN and 2NN (784-200-200-10), the cross-device models of McMahan et al. (2017); the PANs MLP
(784-1024-1024-1024-10), the model of the engines' other benchmarks."""
MLPS = ("twonn", "mlp")
"""The models the vectorised target (>= 2x the plain loop) is set for."""
EXPERIMENT = {
    "strategy": "fedavg",
    "dataset": "fashion-mnist",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.3,
    "batch-size": 10,
    "local-epochs": 1,
    "lr": 0.01,  # with momentum 0.9 (the default); 0.05 diverged twocnn at batch 10
    "evaluate-every": 10,
    "server-evaluate-every": 10,
    "tracking": "none",
    "device": "auto",
    "seed": 0,
}


def plain_run(config: RunConfig, num_clients: int) -> list[dict[str, Any]]:
    """The workload without any engine; one row per round (seconds since the last, and the server's accuracy in
    the rounds it evaluates)."""
    device = select_device(config.device)
    from alignfl.core.data import load_dataset

    dataset = load_dataset(config.dataset)
    sampling = random.Random(config.seed)  # the round runner's stream: train sample, then evaluation sample
    seed_everything(config.seed)
    model = build_run_model(config, dataset).to(device)
    global_state = {k: v.clone() for k, v in federated_state(model).items()}
    data: dict[int, Any] = {}

    def client(pid: int) -> Any:
        if pid not in data:
            split = client_data(config, pid, num_clients)
            data[pid] = tuple(t.to(device) for t in (split.train_x, split.train_y)) + (split.test_x, split.test_y)
        return data[pid]

    per_round = max(int(num_clients * config.fraction_train), 1)
    rows, started, cpu_started = [], time.time(), time.process_time()
    for server_round in range(1, config.num_server_rounds + 1):
        sampled = sorted(sampling.sample(range(num_clients), per_round))
        total = sum(len(client(pid)[1]) for pid in sampled)
        summed = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for pid in sampled:
            train_x, train_y, _, _ = client(pid)
            model.load_state_dict(global_state, strict=False)
            generator = round_generator(config.seed, server_round, pid)
            seed_torch(int(torch.randint(0, 2**62, (1,), generator=generator)), device)  # as a client seeds
            optimizer = torch.optim.SGD(
                model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
            )
            model.train()
            for xb, yb in iterate_batches(train_x, train_y, config.batch_size, generator):
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            for key, value in federated_state(model).items():
                summed[key] += value * (len(train_y) / total)
        global_state = summed
        model.load_state_dict(global_state, strict=False)
        if server_round % config.evaluate_every == 0 or server_round == config.num_server_rounds:
            chosen = sampling.sample(range(num_clients), max(int(num_clients * config.fraction_evaluate), 1))
            for pid in chosen:
                _, _, test_x, test_y = client(pid)
                classification_scores(model, test_x, test_y, device)
        scores: dict[str, float] = {}
        if server_round % config.server_evaluate_every == 0 or server_round == config.num_server_rounds:
            scores["accuracy"] = evaluate(model, dataset.test_x, dataset.test_y, device)[1]
        now, cpu_now = time.time(), time.process_time()
        rows.append({"round": server_round, "seconds": now - started, "cpu-seconds": cpu_now - cpu_started, **scores})
        started, cpu_started = now, cpu_now
    return rows


def engine_run(engine: str, values: dict[str, Any], num_clients: int, ray_cpus: int, folder: Path) -> list[dict]:
    """One run on ``engine``; rows of seconds, CPU seconds (process tree) and, in the rounds the server evaluated,
    accuracy per round."""
    runners: dict[str, Callable[[dict[str, Any]], Any]] = {
        # on a GPU machine each Ray client gets the GPU (Ray hides it from actors without a GPU share)
        "ray": lambda v: simulate(
            {**v, "min-available-nodes": num_clients},
            num_clients,
            ray_cpus,
            client_gpus=float(torch.cuda.is_available()),
        ),
        "inprocess": lambda v: run_in_process(v, num_clients),
        "batched": lambda v: run_batched(v, num_clients, "off"),
        "vectorised": lambda v: run_batched(v, num_clients, "on"),
    }
    values = {**values, "results-dir": str(folder), "run-name": engine}
    sampler = TreeSampler(interval=0.25, tag=RoundCounter(folder / engine / "metrics.jsonl"), memory=False)
    with sampler:
        runners[engine](values)
    cpu_at = sampler.first_per_tag("cpu-s")
    metrics = sorted(run_metrics(folder, engine), key=lambda row: row["round"])
    return [
        {
            "round": row["round"],
            "seconds": seconds,
            "cpu-seconds": cpu_at.get(row["round"] + 1, math.nan) - cpu_at.get(row["round"], math.nan),
            **({"accuracy": row["accuracy"]} if "accuracy" in row else {}),
        }
        for row, seconds in zip(metrics[1:], round_seconds(metrics), strict=True)
    ]


def largest_difference(folder: Path, one: str, other: str) -> float:
    """The largest absolute difference between two runs' final global models (their last checkpoints)."""
    a, b = load_checkpoint(folder / one).arrays, load_checkpoint(folder / other).arrays
    return max(float(abs(a[k].numpy() - b[k].numpy()).max()) for k in a)


def _steady(rows: list[dict[str, Any]], key: str) -> float:
    return median([row[key] for row in rows if row["round"] > 1])


def report(results: dict[str, dict[str, list[dict]]], differences: dict[str, float], setup: str) -> str:
    """Markdown: per model and engine the medians, the ratio to the plain loop, accuracies; then the targets."""
    lines = [
        setup,
        "",
        "| model | engine | s/round (median, rounds 2+) | CPU s/round | round 1 s | × plain | final accuracy | "
        "largest accuracy gap to plain (evaluated rounds) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for model, engines in results.items():
        plain = _steady(engines["plain"], "seconds") if "plain" in engines else math.nan
        for engine, rows in engines.items():
            gap = (
                max(
                    abs(r["accuracy"] - p["accuracy"])
                    for r, p in zip(rows, engines["plain"], strict=True)
                    if "accuracy" in r and "accuracy" in p
                )
                if "plain" in engines
                else math.nan
            )
            cpu = _steady(rows, "cpu-seconds") if "cpu-seconds" in rows[0] else math.nan
            lines.append(
                f"| {model} | {engine} | {_steady(rows, 'seconds'):.3f} | {cpu:.3f} | {rows[0]['seconds']:.2f} | "
                f"{_steady(rows, 'seconds') / plain:.2f} | {rows[-1]['accuracy']:.4f} | {gap:.4f} |"
            )
        seconds = {engine: _steady(rows, "seconds") for engine, rows in engines.items()}
        if {"batched", "plain"} <= set(seconds):
            verdicts.append(_target(f"{model}: batched (sequential) <= 1.2x plain", seconds["batched"] / plain, 1.2))
        best = min(seconds.get("batched", math.inf), seconds.get("vectorised", math.inf))
        if "ray" in seconds and math.isfinite(best):
            verdicts.append(_target(f"{model}: Ray / batched >= 3", seconds["ray"] / best, 3.0, at_least=True))
        if model in MLPS and {"vectorised", "plain"} <= set(seconds):
            verdicts.append(
                _target(f"{model}: plain / vectorised >= 2", plain / seconds["vectorised"], 2.0, at_least=True)
            )
        if model in differences:
            verdicts.append(
                f"{model}: largest parameter difference, vectorised vs sequential: {differences[model]:.3g}"
            )
    return "\n".join(lines + ["", *[f"- {v}" for v in verdicts]])


def _target(name: str, value: float, bound: float, at_least: bool = False) -> str:
    met = value >= bound if at_least else value <= bound
    return f"{name}: {value:.2f} ({'met' if met else f'missed by {abs(value / bound - 1):.0%}'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=50, help="clients that train (and evaluate) per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {list(ENGINES)}")
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, or digits for a smoke test")
    parser.add_argument("--ray-cpus", type=int, default=1, help="CPUs of the Ray simulation (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="folder for rows.jsonl and report.md")
    args = parser.parse_args(argv)
    models, engines = args.models.split(","), args.engines.split(",")
    for chosen, allowed, flag in ((models, MODELS, "--models"), (engines, ENGINES, "--engines")):
        if not set(chosen) <= set(allowed):
            parser.error(f"{flag} {sorted(set(chosen) - set(allowed))} unknown; choose from {list(allowed)}")
    if not 1 <= args.per_round <= args.clients or args.rounds < 2:
        parser.error("need 1 <= --per-round <= --clients and --rounds >= 2")
    torch.set_num_threads(1)
    out = (args.out or Path.home() / "alignfl-results" / f"cross-device-{datetime.now(UTC):%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    fraction = args.per_round / args.clients
    setup = (
        f"{args.clients} clients (Dirichlet 0.3), {args.per_round} per round, batch 10, 1 local epoch, "
        f"{args.rounds} rounds, {args.dataset}; {machine()}; load before {os.getloadavg()}"
    )
    print(f"[cross-device] {setup}; results in {out}", flush=True)
    results: dict[str, dict[str, list[dict]]] = {}
    differences = {}
    for model in models:
        values = {
            **EXPERIMENT,
            "model": model,
            "dataset": args.dataset,
            "num-server-rounds": args.rounds,
            "fraction-train": fraction,
            "fraction-evaluate": fraction,
        }
        results[model] = {}
        with tempfile.TemporaryDirectory(prefix="alignfl-cross-device-") as tmp:
            for engine in engines:
                if engine == "plain":
                    rows = plain_run(parse_run_config(values), args.clients)
                else:
                    rows = engine_run(engine, values, args.clients, args.ray_cpus, Path(tmp))
                results[model][engine] = rows
                append_jsonl(out / "rows.jsonl", {"model": model, "engine": engine, "rounds": rows})
                print(f"[cross-device] {model} on {engine}: " + ", ".join(f"{r['seconds']:.2f}s" for r in rows))
            if {"batched", "vectorised"} <= set(engines):
                differences[model] = largest_difference(Path(tmp), "vectorised", "batched")
    text = report(results, differences, setup + f"; load after {os.getloadavg()}")
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
