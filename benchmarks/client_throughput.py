"""Client-training throughput on the drift study's workload: SGD steps a second, three ways side by side.

The workload of ``+experiment=drift`` on full data: the FedMA study's MLP (``small-mlp``, 784-20-100-120-84-10),
all 60,000 Fashion-MNIST training images split over ``--clients`` clients by Dirichlet(α) (each keeps 20 % as
its local test split, as the study's clients do), batch 32, SGD lr 0.01 with momentum 0.9, ``--epochs`` local
epochs, every client from the same start: one FedAvg round. Clients differ in size, so they run out of steps
at different times. Three ways to train them, one process, torch one thread:

* ``plain``: a plain PyTorch loop, one client after another (``torch.optim.SGD``), the same batches as the
  ClientApp draws (its round generator), then the weighted mean, scored on the test set;
* ``batched``: the batched engine (``sim.vectorise=off``), one FedAvg round of the product's apps;
* ``vectorised``: the same with ``sim.vectorise=on`` (the clients as one stacked update).

A measurement is the wall time of one round (the plain loop's training and mean; the engine's whole
``run_batched`` call, its set-up and the server's two scorings included); steps are the clients' SGD steps,
the same in all three. The ways run interleaved (each repeat in a rotated order) after one untimed warm-up of
each; reported are the medians of ``--repeats`` and their ratios to the plain loop, with the final accuracy of
each (the plain loop's and the batched engine's are equal; the vectorised one's within float32 rounding).
``--strategy fedprox`` trains FedProx's clients instead (μ = 0.01, the drift study's; the plain loop adds the same
proximal term to its loss): its stacked update adds the term's gradient analytically.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_throughput.py --epochs 20 --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_throughput.py --dataset digits --epochs 2 --repeats 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_throughput.py --alphas 0.1 --rounding-check
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_throughput.py --strategy fedprox --epochs 5
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from benchutil import append_jsonl, machine, median, read_jsonl
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import load_dataset
from alignfl.core.model_io import build_run_model, federated_state
from alignfl.core.training.sgd import (
    PlainSGD,
    batch_order,
    evaluate,
    iterate_batches,
    round_generator,
    seed_everything,
    seed_torch,
)
from alignfl.core.training.vectorised import ClientSteps, StackedTrainer, stacked_state_names
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.engines.batched import run_batched

WAYS = ("plain", "batched", "vectorised")


STRATEGIES = {"fedavg": {}, "fedprox": {"fedprox-mu": 0.01}}
"""The algorithms this benchmark trains, with the settings the drift study gives them."""


def workload(dataset: str, alpha: float, clients: int, epochs: int, strategy: str = "fedavg") -> dict[str, Any]:
    """The run config of one round of ``strategy`` (FedAvg or FedProx) on the drift study's MLP on full data."""
    return {
        "strategy": strategy,
        **STRATEGIES[strategy],
        "model": "small-mlp",
        "dataset": dataset,
        "partitioner": "dirichlet",
        "dirichlet-alpha": alpha,
        "batch-size": 32,
        "local-epochs": epochs,
        "lr": 0.01,
        "momentum": 0.9,
        "weight-decay": 0.0,
        "num-server-rounds": 1,
        "fraction-train": 1.0,
        "fraction-evaluate": 1 / clients,  # one client scores the global model: the study's clients all do, cheap
        "min-available-nodes": clients,
        "tracking": "none",
        "device": "cpu",
        "seed": 0,
    }


def steps_of(config: RunConfig, clients: int) -> int:
    """The round's SGD steps over all clients."""
    sizes = [len(client_data(config, pid, clients).train_y) for pid in range(clients)]
    return sum(config.local_epochs * math.ceil(size / config.batch_size) for size in sizes)


def plain_round(config: RunConfig, clients: int) -> float:
    """One round as a plain PyTorch loop (the ClientApp's seeds and batches; FedProx's proximal term where the
    config has one); the global model's accuracy."""
    mu = float(config.settings.fedprox_mu) if config.strategy == "fedprox" else 0.0
    dataset = load_dataset(config.dataset)
    seed_everything(config.seed)
    model = build_run_model(config, dataset)
    start = {k: v.clone() for k, v in federated_state(model).items()}
    data = [client_data(config, pid, clients) for pid in range(clients)]
    total = sum(len(d.train_y) for d in data)
    summed = {k: torch.zeros_like(v) for k, v in start.items()}
    for pid, split in enumerate(data):
        model.load_state_dict(start, strict=False)
        generator = round_generator(config.seed, 1, pid)
        seed_torch(int(torch.randint(0, 2**62, (1,), generator=generator)), torch.device("cpu"))  # as a client
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        model.train()
        for _ in range(config.local_epochs):
            for xb, yb in iterate_batches(split.train_x, split.train_y, config.batch_size, generator):
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(xb), yb)
                if mu:
                    loss = loss + 0.5 * mu * sum((p - start[n]).pow(2).sum() for n, p in model.named_parameters())
                loss.backward()
                optimizer.step()
        for key, value in federated_state(model).items():
            summed[key] += value * (len(split.train_y) / total)
    model.load_state_dict(summed, strict=False)
    return evaluate(model, dataset.test_x, dataset.test_y, torch.device("cpu"))[1]


def engine_round(values: dict[str, Any], clients: int, vectorise: str) -> float:
    """One round on the batched engine; the global model's accuracy."""
    with tempfile.TemporaryDirectory(prefix="alignfl-throughput-") as folder:
        summary = run_batched({**values, "results-dir": folder, "run-name": vectorise}, clients, vectorise)
    return float(summary["final-accuracy"])


def timed(run: Callable[[], float]) -> tuple[float, float]:
    began = time.perf_counter()
    accuracy = run()
    return time.perf_counter() - began, accuracy


def ways_of(args: argparse.Namespace, alpha: float, epochs: int) -> dict[str, Callable[[], float]]:
    """The three ways of one α at ``epochs`` local epochs, each a call returning the global model's accuracy."""
    values = workload(args.dataset, alpha, args.clients, epochs, args.strategy)
    config = parse_run_config(values)
    return {
        "plain": lambda: plain_round(config, args.clients),
        "batched": lambda: engine_round(values, args.clients, "off"),
        "vectorised": lambda: engine_round(values, args.clients, "on"),
    }


def measure(args: argparse.Namespace, out: Path) -> None:
    """Every (α, way) ``--repeats`` times, interleaved; one row per measurement in ``out/rows.jsonl``."""
    runs = {alpha: ways_of(args, alpha, args.epochs) for alpha in args.alphas}
    steps = {
        alpha: steps_of(parse_run_config(workload(args.dataset, alpha, args.clients, args.epochs)), args.clients)
        for alpha in args.alphas
    }
    for alpha in args.alphas:  # warm-up at one epoch: data, partitions, torch.func's first trace
        for way, run in ways_of(args, alpha, 1).items():
            if way in args.ways:
                timed(run)
    for repeat in range(args.repeats):
        ways = args.ways[repeat % len(args.ways) :] + args.ways[: repeat % len(args.ways)]
        for alpha in args.alphas:
            for way in ways:
                seconds, accuracy = timed(runs[alpha][way])
                row = {"alpha": alpha, "way": way, "repeat": repeat, "seconds": seconds, "steps": steps[alpha]}
                append_jsonl(out / "rows.jsonl", {**row, "accuracy": accuracy, "load": os.getloadavg()[0]})
                print(
                    f"[throughput] α={alpha} {way}: {seconds:.2f} s, {steps[alpha] / seconds:.0f} steps/s", flush=True
                )


def rounding_check(args: argparse.Namespace, alpha: float, dtype: torch.dtype) -> dict[str, float]:
    """One round of the workload in ``dtype``, sequential (``PlainSGD``) and stacked from the same start with the
    same batches: the accuracy of each weighted mean and their largest parameter difference. Where float64
    agrees and float32 does not, the float32 gap is rounding grown by training, not a different update."""
    config = parse_run_config(workload(args.dataset, alpha, args.clients, args.epochs))
    dataset = load_dataset(config.dataset)
    seed_everything(config.seed)
    model = build_run_model(config, dataset).to(dtype)
    names = [n for group in stacked_state_names(model) for n in group]
    start = {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}
    data = [client_data(config, pid, args.clients) for pid in range(args.clients)]
    clients = []
    for pid, split in enumerate(data):
        generator = round_generator(config.seed, 1, pid)
        batches = [b for _ in range(config.local_epochs) for b in batch_order(len(split.train_y), 32, generator)]
        clients.append(ClientSteps(split.train_x.to(dtype), split.train_y, batches))
    sequential = []
    for client in clients:
        model.load_state_dict(start, strict=False)
        optimizer = PlainSGD(model.parameters(), config.lr, config.momentum)
        for batch in client.batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(client.x[batch]), client.y[batch]).backward()
            optimizer.step()
        sequential.append({n: t.detach().clone() for n, t in model.state_dict().items() if n in names})
    stacked = StackedTrainer(model, [start] * len(clients), config.lr, config.momentum).run(clients).states
    weights = [len(c.y) / sum(len(d.y) for d in clients) for c in clients]
    scores = {}
    for name, states in (("sequential", sequential), ("stacked", stacked)):
        model.load_state_dict({n: sum(w * s[n] for w, s in zip(weights, states, strict=True)) for n in names})
        scores[name] = evaluate(model, dataset.test_x.to(dtype), dataset.test_y, torch.device("cpu"))[1]
    difference = max(float((a[n] - b[n]).abs().max()) for a, b in zip(sequential, stacked, strict=True) for n in names)
    return {**scores, "largest-difference": difference}


def report(rows: list[dict[str, Any]], setup: str) -> str:
    """Markdown: per α and way the median steps a second, its ratio to the plain loop, the accuracy."""
    lines = [
        setup,
        "",
        "| α | way | steps | median s | steps/s | × plain | final accuracy | repeats |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for alpha in sorted({row["alpha"] for row in rows}):
        mine = [row for row in rows if row["alpha"] == alpha]
        seconds = {way: median([r["seconds"] for r in mine if r["way"] == way]) for way in WAYS}
        for way in WAYS:
            chosen = [r for r in mine if r["way"] == way]
            if not chosen:
                continue
            steps = chosen[0]["steps"]
            lines.append(
                f"| {alpha} | {way} | {steps} | {seconds[way]:.2f} | {steps / seconds[way]:.0f} | "
                f"{seconds.get('plain', math.nan) / seconds[way]:.2f} | {chosen[-1]['accuracy']:.4f} | {len(chosen)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", default="0.1,0.5", help="comma-separated Dirichlet α (the study's: 0.1,0.5)")
    parser.add_argument("--epochs", type=int, default=20, help="local epochs E (default 20: ~10-30 s a way here)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {list(WAYS)}")
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, or digits for a smoke test")
    parser.add_argument("--strategy", default="fedavg", choices=sorted(STRATEGIES), help="whose clients train")
    parser.add_argument("--out", type=Path, default=None, help="folder for rows.jsonl and report.md")
    parser.add_argument(
        "--rounding-check",
        action="store_true",
        help="instead: sequential vs stacked in float32 and float64 (accuracy of the mean, largest difference)",
    )
    args = parser.parse_args(argv)
    args.ways = args.ways.split(",")
    if not set(args.ways) <= set(WAYS):
        parser.error(f"--ways {sorted(set(args.ways) - set(WAYS))} unknown; choose from {list(WAYS)}")
    try:
        args.alphas = [float(a) for a in args.alphas.split(",")]
    except ValueError:
        parser.error(f"--alphas {args.alphas!r}: give comma-separated numbers, e.g. 0.1,0.5")
    if args.epochs < 1 or args.repeats < 1 or args.clients < 2:
        parser.error("need --epochs >= 1, --repeats >= 1 and --clients >= 2")
    torch.set_num_threads(1)
    out = (args.out or Path.home() / "alignfl-results" / f"throughput-{datetime.now(UTC):%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    setup = (
        f"{args.strategy}, small-mlp, {args.dataset}, {args.clients} clients (Dirichlet {args.alphas}), batch 32, lr 0.01, "
        f"momentum 0.9, E = {args.epochs}; {machine()}; load before {os.getloadavg()}"
    )
    print(f"[throughput] {setup}; results in {out}", flush=True)
    if args.rounding_check:
        for alpha in args.alphas:
            for dtype in (torch.float32, torch.float64):
                print(f"[rounding] α={alpha} {dtype}: {rounding_check(args, alpha, dtype)}", flush=True)
        return 0
    measure(args, out)
    text = report(read_jsonl(out / "rows.jsonl"), setup + f"; load after {os.getloadavg()}")
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
