"""Do clients that start from one model drift apart? Units moved between them after one round, by the cost that looks.

The drift study records the units that weight matching moves when every client is aligned onto the lowest
partition's client. Weight matching pairs units by their weights, which keep the shared start's imprint; this
probe asks the same question with two other costs on the same clients: Simple-FedMA's l1 on the weights, and
activation matching (units paired by the correlation of their post-ReLU activations on the same inputs, layer by
layer: Li et al., Convergent Learning, ICLR 2016; Ainsworth et al., Git Re-Basin, ICLR 2023), which ignores
where the weights started. Workload: one FedAvg round of the drift study on full data (``client_throughput``'s:
the FedMA study's MLP, all 60,000 Fashion-MNIST training images over ``--clients`` clients by Dirichlet(α),
batch 32, SGD lr 0.01 with momentum 0.9, E local epochs), every client from one start, trained as one stacked
update (float32). Per (α, E): the share of units moved (mean over the other clients and the hidden layers) by
each cost, and how alike the clients' units stay where they are (mean correlation of unit i with unit i) and
after activation matching.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/units_moved_costs.py --epochs 1 20 50 --alphas 0.1 0.5
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
from benchutil import machine
from client_throughput import workload
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from alignfl.core.data import load_dataset
from alignfl.core.merging.alignment import find_permutations, moved_share
from alignfl.core.model_io import build_run_model
from alignfl.core.training.sgd import batch_order, round_generator, seed_everything
from alignfl.core.training.vectorised import ClientSteps, StackedTrainer, stacked_state_names
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import parse_run_config

PROBE_IMAGES = 2000
"""Test images the activations are read on."""


def trained_clients(alpha: float, epochs: int, clients: int, seed: int) -> tuple[nn.Module, list[dict[str, Tensor]]]:
    """The run's model and its clients' states after one round of ``epochs`` local epochs from its start."""
    config = parse_run_config({**workload("fashion-mnist", alpha, clients, epochs), "seed": seed})
    seed_everything(config.seed)
    model = build_run_model(config, load_dataset(config.dataset))
    names = [n for group in stacked_state_names(model) for n in group]
    start = {n: t.detach().clone() for n, t in model.state_dict().items() if n in names}
    steps = []
    for pid in range(clients):
        split = client_data(config, pid, clients)
        generator = round_generator(config.seed, 1, pid)
        batches = [b for _ in range(epochs) for b in batch_order(len(split.train_y), config.batch_size, generator)]
        steps.append(ClientSteps(split.train_x, split.train_y, batches))
    trainer = StackedTrainer(model, [start] * clients, config.lr, config.momentum)
    return model, trainer.run(steps).states


def activations(model: nn.Module, state: dict[str, Tensor], images: Tensor) -> list[Tensor]:
    """Each hidden layer's post-ReLU activations (images × units) of ``model`` holding ``state``."""
    model.load_state_dict(state, strict=False)
    hidden, layers = images.flatten(1), []
    with torch.no_grad():
        for linear, pan in zip(model.hidden, model.pans, strict=True):
            hidden = torch.relu(pan(linear(hidden)))
            layers.append(hidden)
    return layers


def correlations(reference: Tensor, other: Tensor) -> Tensor:
    """Pearson correlation of every reference unit with every other unit (a dead unit correlates 0)."""
    standard = [(a - a.mean(0)) / a.std(0).clamp_min(1e-8) for a in (reference, other)]
    return standard[0].T @ standard[1] / (len(reference) - 1)


def activation_matching(reference: list[Tensor], other: list[Tensor]) -> tuple[float, float, float]:
    """Share of units activation matching moves, mean correlation of unit i with unit i, and of the pairs it
    chooses; each the mean over the hidden layers."""
    moved, kept, matched = [], [], []
    for ref, oth in zip(reference, other, strict=True):
        corr = correlations(ref, oth)
        _, columns = linear_sum_assignment(-corr.numpy())
        moved.append(float((torch.as_tensor(columns) != torch.arange(len(columns))).double().mean()))
        kept.append(float(corr.diagonal().mean()))
        matched.append(float(corr[torch.arange(len(columns)), torch.as_tensor(columns)].mean()))
    return statistics.fmean(moved), statistics.fmean(kept), statistics.fmean(matched)


def probe(alpha: float, epochs: int, clients: int, seed: int, images: Tensor) -> dict[str, float]:
    """The round's shares moved between clients (everyone onto the first) by each cost."""
    model, states = trained_clients(alpha, epochs, clients, seed)
    spec = model.permutation_spec()
    row: dict[str, float] = {}
    for cost in ("weight", "l1"):
        permutations = [find_permutations(states[0], s, spec, cost) for s in states[1:]]
        row[cost] = statistics.fmean(moved_share(permutations).values())
    reference = activations(model, states[0], images)
    by_activation = [activation_matching(reference, activations(model, s, images)) for s in states[1:]]
    for index, key in enumerate(("activation", "identity-correlation", "matched-correlation")):
        row[key] = statistics.fmean(result[index] for result in by_activation)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 20, 50], help="local epochs E of the round")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5], help="Dirichlet alphas")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    images = load_dataset("fashion-mnist").test_x[:PROBE_IMAGES]
    started = datetime.now(UTC)
    lines = [
        "| α | E | moved by weight matching % | by l1 % | by activation matching % | unit i ~ unit i (corr.) | "
        "matched pairs (corr.) |",
        "|---|---|---|---|---|---|---|",
    ]
    for alpha in args.alphas:
        for epochs in args.epochs:
            row = probe(alpha, epochs, args.clients, args.seed, images)
            lines.append(
                f"| {alpha} | {epochs} | {100 * row['weight']:.1f} | {100 * row['l1']:.1f} | "
                f"{100 * row['activation']:.1f} | {row['identity-correlation']:.3f} | {row['matched-correlation']:.3f} |"
            )
            print(lines[-1], flush=True)
    text = (
        "\n".join(lines) + f"\n\n{started:%Y-%m-%d %H:%M} UTC, seed {args.seed}, {args.clients} clients; {machine()}\n"
    )
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
