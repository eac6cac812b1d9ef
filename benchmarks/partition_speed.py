"""How long partitioning takes without the disk cache: the cases the test suite once timed.

* Dirichlet α = 0.1 over Fashion-MNIST's 60,000 training labels for 100 clients (flwr-datasets re-draws
  until every client is non-empty);
* the infeasible Dirichlet split of the 1,437 digits into 100 clients, which must fail after its 10 draws
  instead of hanging.

Each case runs ``--repeats`` times in a private, empty partition cache; the table gives the median and
range of the wall time and the machine's load.

    .venv/bin/python benchmarks/partition_speed.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from statistics import median

from alignfl.core.data import load_dataset
from alignfl.core.partitioning import partitions


def timed(case: str) -> float:
    """Seconds for one uncached partitioning (the dataset itself is loaded before the clock starts)."""
    with tempfile.TemporaryDirectory() as cache:
        partitions.PARTITION_CACHE_DIR = cache
        partitions._compute_partitions.cache_clear()
        dataset = "fashion-mnist" if case == "dirichlet-100" else "digits"
        load_dataset(dataset)
        start = time.perf_counter()
        try:
            partitions.partition_dataset(dataset, None, "dirichlet", 100, 0, dirichlet_alpha=0.1)
        except ValueError:
            if case != "infeasible-digits":
                raise
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| case | median s | min–max s | load (1 min) |\n|---|---|---|---|")
    for case in ("dirichlet-100", "infeasible-digits"):
        seconds = [timed(case) for _ in range(args.repeats)]
        print(f"| {case} | {median(seconds):.2f} | {min(seconds):.2f}–{max(seconds):.2f} | {os.getloadavg()[0]:.2f} |")


if __name__ == "__main__":
    main()
