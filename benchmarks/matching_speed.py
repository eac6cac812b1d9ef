"""How long the ``matched`` strategy takes to align and average K client models.

For every model and K, K client states are made from one model (``permuted``:
each a random permutation of every group plus Gaussian noise of ``--noise``
times each entry's standard deviation, as if clients had drifted a little;
``independent``: K differently initialised models, the hardest case for
coordinate descent) and :func:`alignfl.core.merging.alignment.matched_average` aligns them
onto the global model and averages them, exactly as one ``matched`` round does
(``matched-reference=global``, one pass). Reported per setting: the medians over
``--repeats`` of the wall time and of the CPU time, the latter split into

* ``cost matrices``: inside :meth:`alignfl.core.merging.alignment.PairScores.share`
  (permuting the client's entries and the matrix products / L1 distances),
* ``solver``: inside ``scipy.optimize.linear_sum_assignment``,
* ``elsewhere``: the rest (summing shares, checks, permuting and averaging the
  client states),

measured by wrapping both functions for the run. CPU seconds of this process
are what it actually computed (with one torch thread); the wall time also
counts waiting for a CPU that other jobs share. Run it alone (under the shared
lock) with a fixed number of torch threads:

    flock /tmp/alignfl-exp.lock python benchmarks/matching_speed.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

import alignfl.core.merging.alignment as alignment
from alignfl.core.data import dataset_info
from alignfl.models import PanSettings, build_model, permute_state, random_permutations

DATASETS = {"mlp": "fashion-mnist", "vgg9": "cifar10", "resnet20": "cifar10"}
CLIENTS = (2, 8, 16, 32)
CLIENT_MODELS = ("permuted", "independent")


class Clock:
    """Seconds spent inside wrapped functions, by label (wrapped functions must not nest).

    ``now`` is the clock read: wall time, or this process's CPU time, which a
    machine shared with other jobs inflates much less.
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.spent: dict[str, float] = {}

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self.now()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + self.now() - started

        return timed


@contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Time the cost matrices and the assignment solver for the duration of the block."""
    share, solver = alignment.PairScores.share, alignment.linear_sum_assignment
    alignment.PairScores.share = clock.wrap("cost matrices", share)
    alignment.linear_sum_assignment = clock.wrap("solver", solver)
    try:
        yield
    finally:
        alignment.PairScores.share, alignment.linear_sum_assignment = share, solver


def _model_state(name: str, seed: int) -> tuple[Any, dict[str, Tensor]]:
    torch.manual_seed(seed)
    input_shape, num_classes = dataset_info(DATASETS[name])
    model = build_model(name, input_shape, num_classes, PanSettings())
    return model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def client_states(name: str, clients: int, kind: str, noise: float, seed: int) -> tuple[Any, dict, list[dict]]:
    """The model's spec, the global state, and ``clients`` client states made as the module notes say."""
    spec, global_state = _model_state(name, seed)
    if kind == "independent":
        return spec, global_state, [_model_state(name, seed + 1 + k)[1] for k in range(clients)]
    generator = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(clients):
        noisy = {
            k: v + noise * v.std() * torch.randn(v.shape, generator=generator)
            if v.is_floating_point() and v.numel() > 1
            else v.clone()
            for k, v in global_state.items()
        }
        states.append(permute_state(spec, noisy, random_permutations(spec, noisy, generator)))
    return spec, global_state, states


def time_round(name: str, clients: int, kind: str, noise: float, seed: int) -> dict[str, float]:
    """One matched-averaging round: wall seconds, CPU seconds, and the CPU breakdown."""
    spec, global_state, states = client_states(name, clients, kind, noise, seed)
    clock = Clock(time.process_time)
    with instrumented(clock):
        wall, cpu = time.perf_counter(), time.process_time()
        alignment.matched_average(
            global_state, states, [1.0] * clients, spec, "weight", 1, torch.Generator().manual_seed(seed)
        )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    parts = {label: clock.spent.get(label, 0.0) for label in ("cost matrices", "solver")}
    return {"wall": wall, "cpu": cpu, **parts, "elsewhere": cpu - sum(parts.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    parser.add_argument("--client-models", default="permuted", choices=CLIENT_MODELS)
    parser.add_argument("--noise", type=float, default=0.01, help="noise (x entry std) of permuted clients")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1 or any(k < 1 for k in args.clients):
        parser.error(
            f"--repeats, --threads and --clients must be >= 1, got {args.repeats}, {args.threads}, {args.clients}"
        )
    torch.set_num_threads(args.threads)
    print(
        f"torch threads {torch.get_num_threads()}, client models {args.client_models}, "
        f"load average before {os.getloadavg()[0]:.2f}"
    )
    print(
        "| model | K | wall (s) | CPU (s) | cost matrices, CPU (s) | solver, CPU (s) | elsewhere, CPU (s) "
        "| solver share of CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for clients in args.clients:
            runs = [time_round(name, clients, args.client_models, args.noise, seed) for seed in range(args.repeats)]
            median = {part: statistics.median(run[part] for run in runs) for part in runs[0]}
            print(
                f"| {name} | {clients} | {median['wall']:.2f} | {median['cpu']:.2f} | "
                f"{median['cost matrices']:.2f} | {median['solver']:.2f} | {median['elsewhere']:.2f} | "
                f"{100 * median['solver'] / median['cpu']:.0f} % |",
                flush=True,
            )
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
