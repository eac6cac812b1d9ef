"""Scale: many simulated clients, partial participation, and the memory of the whole process tree.

Two settings of FedAvg · MLP · Fashion-MNIST · Dirichlet 0.3 through the product's in-process Flower
simulation (the ServerApp and ClientApp that ``flwr run`` runs):

* ``1000``: 1,000 clients, 2 % of them train per round (``fraction-train`` 0.02) and 2 % evaluate;
* ``100``: 100 clients, all of them train and evaluate every round;
* ``10000``: 10,000 clients (IID, 6 training images each), 1 % of them train and 1 % evaluate per round, 20 rounds.

For each: the time to partition the training split among the clients (flwr-datasets; every Ray
worker pays it once), each round's time (``elapsed-s`` differences), and the memory of this process
and all its descendants (Ray's GCS, raylet and workers) sampled every second: the sum of RSS (counts
shared pages once per process, so it overstates) and of PSS (shared pages split among their users:
the true footprint), overall and per round, to show whether it grows with rounds.

    flock /tmp/alignfl-exp.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py
    .venv/bin/python benchmarks/scale.py --setting 1000 --rounds 10 --ray-cpus 2   # one setting
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
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

from alignfl.core.partitioning.partitions import partition_dataset
from alignfl.fl_app.config import RunConfig, parse_run_config

EXPERIMENT = {
    "strategy": "fedavg",
    "model": "mlp",
    "dataset": "fashion-mnist",
    "local-epochs": 1,
    "batch-size": 64,
    "seed": 0,
}
PARTITIONERS = {"dirichlet": {"partitioner": "dirichlet", "dirichlet-alpha": 0.3}, "iid": {"partitioner": "iid"}}


@dataclass(frozen=True)
class Setting:
    clients: int
    fraction: float  # of clients that train, and that evaluate, per round
    rounds: int
    partitioner: str = "dirichlet"  # at 10,000 clients (6 images each) Dirichlet 0.3 leaves clients empty: iid


SETTINGS = {"1000": Setting(1000, 0.02, 10), "100": Setting(100, 1.0, 3), "10000": Setting(10000, 0.01, 20, "iid")}


def setting_config(setting: Setting, dataset: str) -> RunConfig:
    """The run config of one setting."""
    return parse_run_config(
        {
            **EXPERIMENT,
            **PARTITIONERS[setting.partitioner],
            "dataset": dataset,
            "num-server-rounds": setting.rounds,
            "fraction-train": setting.fraction,
            "fraction-evaluate": setting.fraction,
        }
    )


def partition_seconds(dataset: str, setting: Setting) -> float:
    """Seconds to compute every client's partition once, as each Ray worker does (its own seed, so that
    the simulation's workers find nothing cached in this process: they are other processes anyway)."""
    config = setting_config(setting, dataset)
    started = time.perf_counter()
    partition_dataset(
        dataset, None, setting.partitioner, setting.clients, 1000 + setting.clients, **config.partition_options()
    )
    return time.perf_counter() - started


def run_setting(name: str, setting: Setting, ray_cpus: int, dataset: str) -> dict[str, Any]:
    """One simulation with the memory sampler running; its round times and memory figures."""
    config = setting_config(setting, dataset)
    with tempfile.TemporaryDirectory(prefix="alignfl-scale-") as tmp:
        results = Path(tmp)
        settings = {
            **config.to_run_config(),
            "results-dir": str(results),
            "run-name": "run",
            "min-available-nodes": setting.clients,
        }
        sampler = TreeSampler(interval=1.0, tag=RoundCounter(results / "run" / "metrics.jsonl"))
        started = time.time()
        with sampler:
            simulate(settings, setting.clients, ray_cpus)
        wall = time.time() - started
        metrics = sorted(run_metrics(results, "run"), key=lambda row: row["round"])
    per_round = {}  # metrics rows written so far -> peak PSS while the next round ran
    for sample in sampler.samples:
        per_round[sample["tag"]] = max(per_round.get(sample["tag"], 0.0), sample["pss-mib"])
    seconds = round_seconds(metrics)
    return {
        "setting": name,
        "clients": setting.clients,
        "fraction": setting.fraction,
        "rounds": setting.rounds,
        "ray-cpus": ray_cpus,
        "wall-s": wall,
        "round-seconds": seconds,
        "median-round-s-after-first": median(seconds[1:]),
        "clients-trained": [row.get("clients-trained") for row in metrics[1:]],
        "clients-evaluated": [row.get("clients-evaluated") for row in metrics[1:]],
        "final-accuracy": metrics[-1]["accuracy"] if metrics else None,
        "peak-rss-mib": sampler.peak("rss-mib"),
        "peak-pss-mib": sampler.peak("pss-mib"),
        "peak-processes": max((s["processes"] for s in sampler.samples), default=0),
        # round r (1-based) ran while metrics.jsonl held r rows (round 0 is the initial evaluation)
        "peak-pss-mib-per-round": {
            str(rows): round(peak, 1) for rows, peak in sorted(per_round.items()) if 1 <= rows <= setting.rounds
        },
        "machine": machine(),
    }


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| clients | per round (train / evaluate) | partitioning (s) | rounds | round 1 (s) | "
        "median round after 1 (s) | peak RSS sum (MiB) | peak PSS sum (MiB) | PSS per client (MiB) | "
        "peak PSS per round (MiB) | load average (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_round = ", ".join(f"{v:.0f}" for v in row["peak-pss-mib-per-round"].values())
        trained = row["clients-trained"][-1] if row["clients-trained"] else 0
        evaluated = row["clients-evaluated"][-1] if row["clients-evaluated"] else 0
        lines.append(
            f"| {row['clients']} | {trained} / {evaluated} | {row['partition-s']:.1f} | {row['rounds']} | "
            f"{row['round-seconds'][0]:.1f} | {row['median-round-s-after-first']:.1f} | {row['peak-rss-mib']:.0f} | "
            f"{row['peak-pss-mib']:.0f} | {row['peak-pss-mib'] / row['clients']:.2f} | {per_round} | "
            f"{row['machine']['load-average-1-5-15'][0]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        action="append",
        help="run only these settings (repeatable; default: all)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="override each setting's rounds")
    parser.add_argument(
        "--dataset", default="fashion-mnist", help="fashion-mnist (the benchmark) or digits (a smoke test)"
    )
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs Ray may use (default 2, this machine's cores)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for rows.jsonl and report.md (default: a new one under ~/alignfl-results); "
        "an existing folder is resumed: settings already measured are not run again",
    )
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 2:
        parser.error(f"--rounds must be an integer >= 2 (round 1 holds the start-up), got {args.rounds}")
    if args.ray_cpus < 1:
        parser.error(f"--ray-cpus must be a positive integer, got {args.ray_cpus}")
    torch.set_num_threads(1)
    out = (
        args.out or Path.home() / "alignfl-results" / "benchmarks" / f"scale-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    print(f"[scale] {machine()}; results in {out}", flush=True)
    done = {row["setting"] for row in read_jsonl(rows_path)}
    for name in args.setting or ["1000", "100", "10000"]:
        if name in done:
            continue
        setting = SETTINGS[name]
        if args.rounds is not None:
            setting = Setting(setting.clients, setting.fraction, args.rounds, setting.partitioner)
        partition_s = partition_seconds(args.dataset, setting)
        row = {
            **run_setting(name, setting, args.ray_cpus, args.dataset),
            "partition-s": partition_s,
            "load-after": list(os.getloadavg()),
        }
        append_jsonl(rows_path, row)
        print(f"[scale] {name}: {row}", flush=True)
    return write_report(out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
