"""Where a stacked (vectorised) client update stands against one client after another, step for step.

``K`` clients of one model, each with ``--steps`` batches of ``--batch`` random Fashion-MNIST-shaped images,
train from the same start: once one client after another (forward, backward, :class:`alignfl.core.training.sgd.PlainSGD`
with momentum and weight decay: the sequential update's arithmetic), once as one stacked update
(:class:`alignfl.core.training.vectorised.StackedTrainer`: batched products for MLP stacks up to its size limit,
``vmap`` of ``grad`` over the stacked models otherwise). Clients of equal size,
so every stacked step holds all ``K`` (the best case for stacking; a Dirichlet split's unequal clients leave
fewer per step). Reported: milliseconds per client-step (median of ``--repeats``), their ratio, and the
largest parameter difference between the two results.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stacked_step.py --models twonn,mlp --clients 1,6,50
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from benchutil import machine, median
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.model_io import build_model_for
from alignfl.core.training.sgd import PlainSGD
from alignfl.core.training.vectorised import ClientSteps, StackedTrainer, stacked_state_names

LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-5


def sequential(model: nn.Module, start: dict[str, torch.Tensor], clients: list[ClientSteps]) -> list[dict]:
    """Each client from ``start``, one after another; their final states."""
    states = []
    for client in clients:
        model.load_state_dict(start)
        optimizer = PlainSGD(model.parameters(), LR, MOMENTUM, WEIGHT_DECAY)
        for rows in client.batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(client.x[rows]), client.y[rows]).backward()
            optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def stacked(model: nn.Module, start: dict[str, torch.Tensor], clients: list[ClientSteps]) -> list[dict]:
    """The same clients as one stacked update; their final states."""
    names = [n for group in stacked_state_names(model) for n in group]
    trainer = StackedTrainer(model, [{n: start[n] for n in names}] * len(clients), LR, MOMENTUM, WEIGHT_DECAY)
    return trainer.run(clients).states


def timed(run, *args) -> tuple[float, list[dict]]:
    began = time.perf_counter()
    result = run(*args)
    return time.perf_counter() - began, result


def measure(model_name: str, count: int, steps: int, batch: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_model_for(RunConfig(model=model_name), (1, 28, 28), 10)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(steps * batch, 1, 28, 28), torch.randint(0, 10, (steps * batch,))
    batches = [torch.arange(i * batch, (i + 1) * batch) for i in range(steps)]
    clients = [ClientSteps(x, y, batches) for _ in range(count)]
    times: dict[str, list[float]] = {"sequential": [], "stacked": []}
    for _ in range(repeats + 1):  # the first of each is a warm-up (torch.func's first call traces)
        seconds, one = timed(sequential, model, start, clients)
        times["sequential"].append(seconds)
        seconds, other = timed(stacked, model, start, clients)
        times["stacked"].append(seconds)
    per_step = {k: median(v[1:]) / (count * steps) * 1e3 for k, v in times.items()}
    difference = max(float((a[k] - b[k]).abs().max()) for a, b in zip(one, other, strict=True) for k in b)
    return {**per_step, "difference": difference}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="twonn,mlp", help="comma-separated model names")
    parser.add_argument("--clients", default="1,6,50", help="comma-separated numbers of clients stacked")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{machine()}; {args.steps} steps of batch {args.batch}")
    print(
        "| model | clients | sequential ms/client-step | stacked ms/client-step | sequential / stacked | "
        "largest parameter difference |"
    )
    print("|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for count in map(int, args.clients.split(",")):
            row = measure(model_name, count, args.steps, args.batch, args.repeats)
            print(
                f"| {model_name} | {count} | {row['sequential']:.3f} | {row['stacked']:.3f} | "
                f"{row['sequential'] / row['stacked']:.2f} | {row['difference']:.2g} |",
                flush=True,
            )
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
