"""How long one universe (C2M3) matching of K client models takes, against aligning them onto a reference.

For a model and K, K client states are made as ``benchmarks/matching_speed.py``
makes them (``permuted``: random permutations of one model plus Gaussian noise
of ``--noise`` times each entry's standard deviation, as clients that drifted a
little from one global model; ``independent``: K differently initialised
models, where Frank-Wolfe has the most to do; ``trained``: K models trained
``--epochs`` on their own Dirichlet shares of the digits from their own
initialisations, as the merge tool's ``--init different`` trains them, at the
digits' input shape). Reported per setting: the wall
and CPU seconds of :func:`alignfl.core.merging.universe.universe_merge` (what one
``matched-reference=universe`` round computes before its diagnostic), split
into the pairwise start (K - 1 weight matchings onto client 0) and Frank-Wolfe
(with the projection); the number of Frank-Wolfe steps and the objective at the
start and at the end; the seconds of the round's cycle-consistency diagnostic
(:func:`alignfl.core.merging.universe.cycle_consistency_error`); and, for comparison, the
seconds of :func:`alignfl.core.merging.alignment.matched_average` onto the global model
(``matched-reference=global``). Run it alone (under the shared lock) with one
torch thread:

    flock -x /tmp/alignfl.lock python benchmarks/universe_speed.py --model small-mlp --clients 16
    flock -x /tmp/alignfl.lock python benchmarks/universe_speed.py --model vgg9 --width-factor 0.125 --clients 8
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import alignfl.core.merging.universe as universe
from alignfl.core.data import dataset_info
from alignfl.core.merging.alignment import matched_average
from alignfl.models import PanSettings, build_model, permute_state, random_permutations

CLIENT_MODELS = ("permuted", "independent", "trained")


def _state(name: str, dataset: str, width: float | None, seed: int) -> tuple:
    torch.manual_seed(seed)
    shape, classes = dataset_info(dataset)
    options = {} if width is None else {"width_factor": width}
    model = build_model(name, shape, classes, PanSettings(), **options)
    return model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def client_states(args: argparse.Namespace, kind: str) -> tuple:
    """The spec, the global state and the clients' states (module notes)."""
    if kind == "trained":
        from alignfl.fl_app.analysis.merge import train_clients
        from alignfl.fl_app.config import parse_run_config

        options = {} if args.width_factor is None else {"width-factor": args.width_factor}
        config = parse_run_config(
            {"model": args.model, "dataset": "digits", "local-epochs": args.epochs, "seed": args.seed, **options}
        )
        states, _, _, _ = train_clients(config, args.clients, same_init=False, device=torch.device("cpu"))
        spec, _ = _state(args.model, "digits", args.width_factor, args.seed)
        return spec, states[0], states  # the reference a one-shot round aligns onto: the first client's model
    spec, global_state = _state(args.model, args.dataset, args.width_factor, args.seed)
    if kind == "independent":
        others = [
            _state(args.model, args.dataset, args.width_factor, args.seed + 1 + k)[1] for k in range(args.clients)
        ]
        return spec, global_state, others
    generator = torch.Generator().manual_seed(args.seed)
    states = []
    for _ in range(args.clients):
        noisy = {
            k: v + args.noise * v.std() * torch.randn(v.shape, generator=generator)
            if v.is_floating_point() and v.numel() > 1
            else v.clone()
            for k, v in global_state.items()
        }
        states.append(permute_state(spec, noisy, random_permutations(spec, noisy, generator)))
    return spec, global_state, states


def measure(args: argparse.Namespace, kind: str) -> dict[str, float]:
    spec, global_state, states = client_states(args, kind)
    weights = [1.0] * len(states)
    spent = {"start": 0.0}
    pairwise = universe._pairwise

    def timed(*a, **k):
        started = time.process_time()
        try:
            return pairwise(*a, **k)
        finally:
            spent["start"] += time.process_time() - started

    universe._pairwise = timed
    try:
        settings = universe.UniverseSettings(args.iterations, args.tolerance)
        wall, cpu = time.perf_counter(), time.process_time()
        _, match = universe.universe_merge(states, weights, spec, settings, torch.Generator().manual_seed(args.seed))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        universe._pairwise = pairwise
    diagnostic = time.perf_counter()
    universe.cycle_consistency_error(global_state, states, spec, generator=torch.Generator().manual_seed(args.seed))
    diagnostic = time.perf_counter() - diagnostic
    reference = time.perf_counter()
    matched_average(global_state, states, weights, spec, "weight", 1, torch.Generator().manual_seed(args.seed))
    reference = time.perf_counter() - reference
    return {
        "wall": wall,
        "cpu": cpu,
        "start": spent["start"],
        "frank-wolfe": cpu - spent["start"],
        "steps": len(match.objective) - 1,
        "objective-start": match.objective[0],
        "objective-end": match.projected,
        "diagnostic": diagnostic,
        "reference": reference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-mlp")
    parser.add_argument(
        "--dataset", default="fashion-mnist", help="the input shape and class count (default: fashion-mnist)"
    )
    parser.add_argument("--width-factor", type=float, default=None, help="the model's width-factor (default: its own)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--client-models", nargs="+", default=list(CLIENT_MODELS), choices=CLIENT_MODELS)
    parser.add_argument("--noise", type=float, default=0.01, help="noise (x entry std) of permuted clients")
    parser.add_argument("--epochs", type=int, default=5, help="local epochs of trained clients (default: 5)")
    parser.add_argument("--iterations", type=int, default=100, help="Frank-Wolfe iteration cap (default: 100)")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="Frank-Wolfe relative tolerance (default: 1e-6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if args.clients < 2 or args.threads < 1:
        parser.error(f"--clients must be >= 2 and --threads >= 1, got {args.clients}, {args.threads}")
    torch.set_num_threads(args.threads)
    width = "" if args.width_factor is None else f" (width-factor {args.width_factor})"
    print(
        f"{args.model}{width} on {args.dataset}'s input shape, K = {args.clients}, torch threads "
        f"{torch.get_num_threads()}, load average before {os.getloadavg()[0]:.2f}"
    )
    print(
        "| clients | universe wall (s) | CPU (s) | pairwise start, CPU (s) | Frank-Wolfe, CPU (s) | steps "
        "| objective start -> end | diagnostic wall (s) | onto the global model, wall (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.client_models:
        r = measure(args, kind)
        print(
            f"| {kind} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['start']:.2f} | {r['frank-wolfe']:.2f} | {r['steps']} "
            f"| {r['objective-start']:.6g} -> {r['objective-end']:.6g} | {r['diagnostic']:.2f} | {r['reference']:.2f} |"
        )
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
