"""OT fusion against averaging, one-to-one matching and BBP-MAP; clients of different widths (Fashion-MNIST).

Three parts, each row appended to ``<out>/<part>.jsonl`` (finished rows are skipped, so a stopped run resumes):

* ``merge``: one-shot fusion of K = 2, 4, 8 independently trained ``small-mlp`` models (different
  initialisations, Dirichlet α = 0.5 over a ``train-size`` subset): plain average, Hungarian matching (Git
  Re-Basin weight matching and Simple-FedMA's L1), BBP-MAP, OT exact and OT Sinkhorn, onto client 0.
* ``federated``: ``fedavg``, ``matched`` and ``otfusion`` at Dirichlet α = 0.1 and 0.5 (in-process grid).
* ``widths``: clients of widths 0.25 / 0.5 / 1 (cycled) with ``otfusion`` (``otfusion-downsize`` ot and slice)
  and ``heterofl`` (with and without its scaler), against ``fedavg``
  with every client at 0.25 (the smallest width everyone can train).

``--report`` prints Markdown tables (mean ± std over seeds, test accuracy of the server's model).

    nice -n 15 python benchmarks/ot_experiment.py --part merge --seeds 0 1 2
    nice -n 15 python benchmarks/ot_experiment.py --part federated --seeds 0 1 2
    nice -n 15 python benchmarks/ot_experiment.py --part widths --seeds 0 1 2
    python benchmarks/ot_experiment.py --report --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import append_jsonl, read_jsonl  # noqa: E402  (a sibling script, not a package)
from pan_experiment import mean_std  # noqa: E402

DEFAULT_OUT = HERE / "runs" / "ot"
DATA = {"dataset": "fashion-mnist", "model": "small-mlp", "train-size": 12000, "device": "cpu", "batch-size": 64}
MERGE_K = (2, 4, 8)
MERGE_COSTS = ("weight", "l1", "bbp", "ot")
FED = {"num-server-rounds": 5, "local-epochs": 1, "min-available-nodes": 10, "tracking": "none"}
FED_STRATEGIES = ("fedavg", "matched", "otfusion")
ALPHAS = (0.1, 0.5)
WIDTH_RUNS = {
    "otfusion": {"strategy": "otfusion", "client-widths": "0.25,0.5,1"},
    "otfusion (slice)": {"strategy": "otfusion", "client-widths": "0.25,0.5,1", "otfusion-downsize": "slice"},
    "heterofl": {"strategy": "heterofl", "client-widths": "0.25,0.5,1"},
    "heterofl (no scaler)": {"strategy": "heterofl", "client-widths": "0.25,0.5,1", "heterofl-scaler": False},
    "fedavg@0.25": {"strategy": "fedavg", "client-widths": "0.25"},
}


Planned = Iterable[tuple[dict[str, Any], Callable[[], dict[str, Any]]]]
"""Rows to measure: each row's id and settings, and what measures it (its results, added to the row)."""


def _measure_rows(path: Path, planned: Planned) -> None:
    """Every planned row whose id ``path`` lacks: measured, appended to ``path`` with the seconds it took, and
    printed (so a stopped part resumes where it stopped)."""
    done = {row["id"] for row in read_jsonl(path)} if path.exists() else set()
    for row, measure in planned:
        if row["id"] in done:
            continue
        started = time.perf_counter()
        row = {**row, **measure()}
        append_jsonl(path, {**row, "seconds": time.perf_counter() - started})
        print(json.dumps(row), flush=True)


def _merge(seed: int, k: int) -> dict[str, Any]:
    """Each of ``k`` clients' accuracy, and each one-shot merge's (Sinkhorn OT's included)."""
    import torch

    from alignfl.core.model_io import build_run_model
    from alignfl.core.training.sgd import evaluate
    from alignfl.fl_app.analysis.merge import merge_accuracies, strategy_merge, train_clients
    from alignfl.fl_app.config import parse_run_config

    config = parse_run_config({**DATA, "seed": seed, "local-epochs": 2, "dirichlet-alpha": 0.5})
    device = torch.device("cpu")
    states, counts, dataset, classes = train_clients(config, k, same_init=False, device=device)
    model = build_run_model(config, dataset)
    x, y = dataset.test_x, dataset.test_y
    clients, merged, _ = merge_accuracies(config, model, states, counts, x, y, MERGE_COSTS, 1, device, classes)
    soft = strategy_merge(config, model, "otfusion", {"otfusion-exact": False}, states, counts, states[0])
    model.load_state_dict(soft.arrays.to_torch_state_dict())
    merged["matched-ot-sinkhorn"] = evaluate(model, x, y, device)[1]
    return {"clients": clients, "merged": merged}


def run_merge(seeds: list[int], out: Path) -> None:
    planned = (
        ({"id": f"seed{seed}-k{k}", "seed": seed, "k": k}, partial(_merge, seed, k)) for seed in seeds for k in MERGE_K
    )
    _measure_rows(out / "merge.jsonl", planned)


def _federated(run: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    """The final accuracy of a federated run named ``name`` (in-process grid)."""
    from alignfl.fl_app.client_app import build_client_app
    from alignfl.fl_app.config import parse_run_config
    from alignfl.fl_app.inprocess import InProcessGrid
    from alignfl.fl_app.server_app import run_experiment

    values = {**DATA, **FED, "results-dir": str(out / "runs"), "run-name": name, **run}
    summary = run_experiment(
        InProcessGrid(build_client_app(values), FED["min-available-nodes"]), parse_run_config(values)
    )
    return {"accuracy": summary["final-accuracy"]}


def run_federated(seeds: list[int], out: Path) -> None:
    def planned() -> Planned:
        for seed in seeds:
            for alpha in ALPHAS:
                for strategy in FED_STRATEGIES:
                    row = {"id": f"{strategy}-a{alpha}-seed{seed}", "strategy": strategy, "alpha": alpha, "seed": seed}
                    run = {"strategy": strategy, "dirichlet-alpha": alpha, "seed": seed}
                    yield row, partial(_federated, run, out, row["id"])

    _measure_rows(out / "federated.jsonl", planned())


def run_widths(seeds: list[int], out: Path) -> None:
    def planned() -> Planned:
        for seed in seeds:
            for label, width_run in WIDTH_RUNS.items():
                row = {"id": f"{label.replace(' ', '_')}-seed{seed}", "method": label, "seed": seed}
                run = {**width_run, "dirichlet-alpha": 0.5, "seed": seed, "local-epochs": 2}
                yield row, partial(_federated, run, out, row["id"])

    _measure_rows(out / "widths.jsonl", planned())


def report(out: Path, seeds: list[int]) -> str:
    lines = []
    merges = (
        [r for r in read_jsonl(out / "merge.jsonl") if r["seed"] in seeds] if (out / "merge.jsonl").exists() else []
    )
    if merges:
        names = list(merges[0]["merged"])
        lines += ["| K | best client | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
        for k in MERGE_K:
            rows = [r for r in merges if r["k"] == k]
            if rows:
                cells = [mean_std([max(r["clients"]) for r in rows])]
                cells += [mean_std([r["merged"][n] for r in rows]) for n in names]
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
    if (out / "federated.jsonl").exists():
        fed = [r for r in read_jsonl(out / "federated.jsonl") if r["seed"] in seeds]
        lines += ["| α | " + " | ".join(FED_STRATEGIES) + " |", "|---" * (len(FED_STRATEGIES) + 1) + "|"]
        for alpha in ALPHAS:
            cells = [
                mean_std([r["accuracy"] for r in fed if r["alpha"] == alpha and r["strategy"] == s])
                for s in FED_STRATEGIES
            ]
            lines.append(f"| {alpha} | " + " | ".join(cells) + " |")
        lines.append("")
    if (out / "widths.jsonl").exists():
        widths = [r for r in read_jsonl(out / "widths.jsonl") if r["seed"] in seeds]
        lines += ["| " + " | ".join(WIDTH_RUNS) + " |", "|---" * len(WIDTH_RUNS) + "|"]
        lines.append(
            "| " + " | ".join(mean_std([r["accuracy"] for r in widths if r["method"] == m]) for m in WIDTH_RUNS) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("merge", "federated", "widths"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        {"merge": run_merge, "federated": run_federated, "widths": run_widths}[args.part](args.seeds, args.out)
    if args.report:
        print(report(args.out, args.seeds))


if __name__ == "__main__":
    main()
