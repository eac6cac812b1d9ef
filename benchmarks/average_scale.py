"""How much the plain average of K independently initialised models shrinks their signal: the std of the logits on
Fashion-MNIST test images, for one model and for the coordinate-wise mean of K, each client's initialisation the
one ``client-init=independent`` draws.

Averaging K uncorrelated weight matrices divides each layer's weights by about sqrt(K); a plain (un-normalised)
net multiplies that over its depth, so the average of 16 nine-layer nets starts near zero output, where a
federation that starts from it (FedMA's protocol's FedAvg and FedProx) has almost no gradient to learn from.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/average_scale.py
"""

from __future__ import annotations

import argparse
import statistics

import torch
from benchutil import machine

from alignfl.core.data import load_dataset
from alignfl.core.merging.alignment import weighted_average
from alignfl.core.model_io import build_run_model, independent_start
from alignfl.fl_app.config import parse_run_config

NETWORKS = {
    "small-mlp": {"model": "small-mlp"},
    "vgg9": {"model": "vgg9", "width-factor": 0.0625, "init": "he"},
}
"""Run-config values of each network, as the FedMA protocol's presets build them."""


def logit_std(network: str, clients: int, seed: int, images: torch.Tensor) -> float:
    """The logits' std (over images and classes) of the mean of ``clients`` independent initialisations."""
    config = parse_run_config({"dataset": "fashion-mnist", "seed": seed, **NETWORKS[network]})
    dataset = load_dataset(config.dataset)
    model = build_run_model(config, dataset)
    states = [independent_start(config, dataset.input_shape, dataset.num_classes, k) for k in range(clients)]
    model.load_state_dict(weighted_average(states, [1.0] * clients), strict=False)
    model.eval()
    with torch.no_grad():
        return model(images).std().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--images", type=int, default=1000, help="the first N test images")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = load_dataset("fashion-mnist").test_x[: args.images]
    print(f"machine: {machine()}")
    print("| network | K | logits' std (mean of seeds) | × one model |")
    print("|---|---|---|---|")
    for network in NETWORKS:
        one = None
        for clients in args.clients:
            std = statistics.mean(logit_std(network, clients, seed, images) for seed in range(args.seeds))
            one = std if one is None else one
            print(f"| {network} | {clients} | {std:.3g} | {std / one:.2g} |")


if __name__ == "__main__":
    main()
