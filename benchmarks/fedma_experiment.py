"""FedMA with its own matching (BBP-MAP, the global model may grow) against one-to-one matching and FedAvg.

``--part merge``: one-shot merges of K differently initialised models (small-mlp, Fashion-MNIST, Dirichlet 0.5,
``--merge-epochs`` local epochs each): plain average, one-to-one weight matching, BBP-MAP and the ensemble,
with BBP-MAP's global width per layer (the merge tool, ``python -m alignfl.fl_app.analysis merge``).

``--part federated``: FedAvg, FedMA with BBP-MAP and FedMA with one-to-one weight matching across K clients
at equal communication: every server round is one exchange, FedMA spends one per layer plus one for the
output layer, so all run ``--rounds`` rounds (a multiple of FedMA's cycle). Runs go through the real
ServerApp and ClientApp in one process (:func:`alignfl.fl_app.inprocess.run_in_process`). Finished runs are
skipped; seeds are the outer loop.

    python benchmarks/fedma_experiment.py --part merge --seeds 0 1 2
    python benchmarks/fedma_experiment.py --part federated --seeds 0 1 2
    python benchmarks/fedma_experiment.py --report --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "runs" / "fedma"
MERGE_CLIENTS = (2, 5, 16)
CLIENTS = (2, 5, 10, 20)
BASE: dict[str, Any] = {
    "model": "small-mlp",
    "dataset": "fashion-mnist",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.5,
    "device": "cpu",
}
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "fedavg"},
    "FedMA (BBP-MAP)": {"strategy": "fedma", "fedma-matching": "bbp"},
    "FedMA (one-to-one)": {"strategy": "fedma", "fedma-matching": "weight"},
}


def mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * spread:.1f}"


def run_merges(args: argparse.Namespace, out: Path) -> None:
    from alignfl.fl_app.analysis.__main__ import main as analysis

    for seed in args.seeds:
        for clients in MERGE_CLIENTS:
            folder = out / "merge" / f"k{clients}-seed{seed}"
            if (folder / "merge.json").is_file():
                continue
            started = time.time()
            code = analysis(
                [
                    "merge",
                    "--model",
                    BASE["model"],
                    "--dataset",
                    BASE["dataset"],
                    "--clients",
                    str(clients),
                    "--init",
                    "different",
                    "--epochs",
                    str(args.merge_epochs),
                    "--costs",
                    "weight",
                    "bbp",
                    "--seed",
                    str(seed),
                    "--device",
                    "cpu",
                    "--out",
                    str(folder),
                ]
            )
            if code != 0:
                raise SystemExit(f"merge K={clients} seed={seed} failed with exit code {code}")
            record = json.loads((folder / "merge.json").read_text())
            record.update({"wall-s": time.time() - started, "load": os.getloadavg()[0]})
            (folder / "merge.json").write_text(json.dumps(record, indent=1))


def run_federated(args: argparse.Namespace, out: Path) -> None:
    from alignfl.fl_app.inprocess import run_in_process

    for seed in args.seeds:
        for clients in CLIENTS:
            for method, settings in METHODS.items():
                name = f"{method.split()[0].lower()}-{settings.get('fedma-matching', 'avg')}-k{clients}-seed{seed}"
                if (out / "federated" / name / "summary.json").is_file():
                    continue
                started = time.time()
                run_in_process(
                    {
                        **BASE,
                        **settings,
                        "num-server-rounds": args.rounds,
                        "seed": seed,
                        "results-dir": str(out / "federated"),
                        "run-name": name,
                    },
                    clients,
                )
                print(
                    f"[fedma-experiment] {name}: {time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )


def merge_table(out: Path, seeds: list[int]) -> str:
    lines = [
        "| K | average | matched-weight | matched-bbp | ensemble | BBP global width (clients: 20-100-120-84) | "
        "wall s (load) |",
        "|---|---|---|---|---|---|---|",
    ]
    for clients in MERGE_CLIENTS:
        records = [
            json.loads(p.read_text())
            for seed in seeds
            if (p := out / "merge" / f"k{clients}-seed{seed}" / "merge.json").is_file()
        ]
        if not records:
            continue
        cells = [
            mean_std([r["merged-accuracy"][key] for r in records])
            for key in ("average", "matched-weight", "matched-bbp", "ensemble")
        ]
        widths = ["-".join(str(v) for v in r["bbp-global-width"].values()) for r in records]
        timing = f"{statistics.median(r['wall-s'] for r in records):.0f} ({statistics.median(r['load'] for r in records):.1f})"
        lines.append(f"| {clients} | " + " | ".join(cells) + f" | {'; '.join(widths)} | {timing} |")
    return "\n".join(lines) + f"\n\n(mean ± std over seeds {seeds}, test accuracy in %)"


def federated_table(out: Path, seeds: list[int]) -> str:
    lines = ["| K | " + " | ".join(METHODS) + " | FedMA (BBP-MAP) final width |", "|---|" + "---|" * (len(METHODS) + 1)]
    for clients in CLIENTS:
        cells, widths = [], "–"
        for method, settings in METHODS.items():
            finals = []
            for seed in seeds:
                folder = (
                    out
                    / "federated"
                    / f"{method.split()[0].lower()}-{settings.get('fedma-matching', 'avg')}-k{clients}-seed{seed}"
                )
                if (folder / "summary.json").is_file():
                    finals.append(json.loads((folder / "summary.json").read_text())["final-accuracy"])
                    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
                    if settings.get("fedma-matching") == "bbp" and rows[-1].get("global-width"):
                        widths = "-".join(str(v) for v in rows[-1]["global-width"].values())
            cells.append(f"{mean_std(finals)} (n={len(finals)})")
        lines.append(f"| {clients} | " + " | ".join(cells) + f" | {widths} |")
    return "\n".join(lines) + f"\n\n(final global test accuracy in %, mean ± std over seeds {seeds})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("merge", "federated"))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10, help="server rounds = exchanges (a multiple of 5)")
    parser.add_argument("--merge-epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.part == "merge":
        run_merges(args, args.out)
    elif args.part == "federated":
        run_federated(args, args.out)
    if args.report:
        print("## One-shot merge\n\n" + merge_table(args.out, args.seeds))
        print("\n## Federated, equal communication\n\n" + federated_table(args.out, args.seeds))


if __name__ == "__main__":
    main()
