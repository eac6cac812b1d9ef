"""How long one BBP-MAP matching pass (:func:`alignfl.core.merging.bbp_model.bbp_matched_average`) takes over K VGG-9
clients.

A pass matches every hidden group of the model, input side first, each until
its assignment settles (at most ``iterations`` sweeps), and builds the grown
global state: what FedMA's server does once per model. The clients are
synthetic: one VGG-9 at PyTorch's initialisation, times ``--scale``, and per
client Gaussian noise of ``--noise`` times each entry's standard deviation and
a random permutation of every group (clients that drifted apart from one
start). Models:

* ``cifar10``: the FedMA paper's CIFAR-10 VGG-9 (``alignfl.models.vgg.vgg9`` at width
  factor 1: convs 32, 64, 128, 128, 256, 256, FCs 512, 512, 3 x 32 x 32 input);
* ``mnist``: the narrower variant on 1 x 28 x 28 input, every width times
  ``--mnist-width``.

Reported per setting, medians over ``--repeats``: wall seconds and CPU
seconds of this process (all torch threads), the latter split into building
the cost matrices (:func:`alignfl.core.merging.bbp.extended_cost`), solving them
(``scipy.optimize.linear_sum_assignment``) and the rest (unit vectors,
removing and adding clients, scattering inputs, averaging), measured by
wrapping both functions; the number of client matches (cost matrices built);
how much wider the global model is than a client's; and the 1-minute load
average read right after every repeat (the machine is shared: wall times
under load overstate). Run it alone, under the shared lock:

    flock /tmp/alignfl-exp.lock python benchmarks/bbp_speed.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import scipy.optimize
import torch
from torch import Tensor

import alignfl.core.merging.bbp as bbp
from alignfl.core.merging.bbp_model import bbp_matched_average
from alignfl.models import PanSettings, build_model, permute_state, random_permutations
from alignfl.models.protocol import head_of

INPUTS = {"cifar10": (3, 32, 32), "mnist": (1, 28, 28)}
CLASSES = 10
HEADLINE_CLIENTS = 16


class CpuClock:
    """CPU seconds of this process spent inside wrapped functions, by label."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.process_time() - started
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed


@contextmanager
def instrumented(clock: CpuClock) -> Iterator[None]:
    """Time cost building and solving for the duration of the block (alignfl.core.merging.bbp imports the solver from
    scipy.optimize when it matches, so the solver is replaced there)."""
    cost, solver = bbp.extended_cost, scipy.optimize.linear_sum_assignment
    bbp.extended_cost, scipy.optimize.linear_sum_assignment = clock.wrap("cost", cost), clock.wrap("solve", solver)
    try:
        yield
    finally:
        bbp.extended_cost, scipy.optimize.linear_sum_assignment = cost, solver


def client_states(
    data: str, width: float, clients: int, scale: float, noise: float, seed: int
) -> tuple[Any, tuple[str, ...], list[dict[str, Tensor]]]:
    """The VGG-9 spec, its output layer's keys and ``clients`` drifted, permuted copies of one scaled
    initialisation."""
    torch.manual_seed(seed)
    model = build_model("vgg9", INPUTS[data], CLASSES, PanSettings(), width_factor=width)
    spec = model.permutation_spec()
    base = {key: scale * value.detach() for key, value in model.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(clients):
        noisy = {
            key: value + noise * value.std() * torch.randn(value.shape, generator=generator)
            for key, value in base.items()
        }
        states.append(permute_state(spec, noisy, random_permutations(spec, noisy, generator)))
    return spec, head_of(model).keys, states


def time_pass(data: str, width: float, clients: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One matching pass: wall and CPU seconds, the CPU split, client matches, growth and the load after."""
    spec, head, states = client_states(data, width, clients, args.scale, args.noise, seed)
    settings = bbp.BBPSettings(iterations=args.iterations)
    clock = CpuClock()
    with instrumented(clock):
        wall, cpu = time.perf_counter(), time.process_time()
        result = bbp_matched_average(states, [1.0] * clients, spec, settings, seed, head=head)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    cost, solve = clock.spent.get("cost", 0.0), clock.spent.get("solve", 0.0)
    growth = sum(result.widths.values()) / sum(spec.group_sizes(states[0]).values()) - 1.0
    return {
        "wall": wall,
        "cpu": cpu,
        "cost": cost,
        "solve": solve,
        "rest": cpu - cost - solve,
        "matches": clock.calls.get("cost", 0),
        "growth": growth,
        "load": os.getloadavg()[0],
    }


def settings_to_run(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """The headline (both models at K = 16), then CIFAR-10 VGG-9 over K and over width factors."""
    runs = [("cifar10", 1.0, HEADLINE_CLIENTS), ("mnist", args.mnist_width, HEADLINE_CLIENTS)]
    runs += [("cifar10", 1.0, k) for k in args.clients]
    runs += [("cifar10", w, HEADLINE_CLIENTS) for w in args.widths]
    return list(dict.fromkeys(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="K for the K sweep")
    parser.add_argument(
        "--widths",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 1.0, 2.0],
        help="VGG-9 width factors for the width sweep (at K = 16)",
    )
    parser.add_argument("--mnist-width", type=float, default=0.5, help="width factor of the MNIST variant")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplier of the initial weights")
    parser.add_argument("--noise", type=float, default=0.1, help="client noise (x each entry's std)")
    parser.add_argument("--iterations", type=int, default=bbp.BBPSettings().iterations, help="most sweeps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1 or min(args.clients) < 2 or min(args.widths) <= 0:
        parser.error("--repeats and --threads must be >= 1, --clients >= 2 and --widths > 0")
    torch.set_num_threads(args.threads)
    print(
        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, torch {torch.__version__}, "
        f"scale {args.scale}, noise {args.noise}, iterations {args.iterations}, repeats {args.repeats}, "
        f"load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "| model | width | K | wall (s) | CPU (s) | cost building, CPU (s) | solving, CPU (s) | rest, CPU (s) "
        "| client matches | global growth | load (1 min) after each repeat |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for data, width, clients in settings_to_run(args):
        runs = [time_pass(data, width, clients, args, seed) for seed in range(args.repeats)]
        med = {part: statistics.median(run[part] for run in runs) for part in runs[0]}
        loads = "/".join(f"{run['load']:.2f}" for run in runs)
        print(
            f"| vgg9 {data} | {width:g} | {clients} | {med['wall']:.2f} | {med['cpu']:.2f} | {med['cost']:.2f} | "
            f"{med['solve']:.2f} | {med['rest']:.2f} | {med['matches']:.0f} | {100 * med['growth']:.1f} % | "
            f"{loads} |",
            flush=True,
        )
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
