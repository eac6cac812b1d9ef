"""FedAvg versus matched averaging versus FedMA across client counts at equal communication.

Holm, Sajjad and Matjasec, "L46 FedMA Project" (project report), compare the methods at an equal number of client-server
exchanges: one FedMA round costs one communication per layer, so FedAvg gets as
many rounds as FedMA has communications. Here every server round of a run is
one communication (``fedma`` spends ``G + 1`` of them per cycle for a model
with ``G`` permutation groups), so all three strategies run the same
``num-server-rounds``; it must be a multiple of the FedMA cycle so FedMA ends
on a finished cycle.

``--part federated`` runs one experiment on the in-process engine per (seed, K,
strategy) through :func:`pan_experiment.simulate`; ``--part merge`` runs the
one-shot merge tool (``python -m alignfl.fl_app.analysis merge``, differently
initialised models) for each (seed, K); ``--part pan`` measures what matching
does to models trained with PANs on (:func:`pan_measurement`). Finished runs are skipped, so the
script can be stopped and resumed; seeds are the outer loop, so a stopped run
leaves complete comparisons for the seeds it finished. ``--report`` prints
Markdown tables (mean ± std over seeds) and writes a plot.

    python benchmarks/matching_experiment.py --part federated --seeds 0 1 2
    python benchmarks/matching_experiment.py --part merge --seeds 0 1 2
    python benchmarks/matching_experiment.py --part pan --seeds 0 1 2
    python benchmarks/matching_experiment.py --report --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pan_experiment import PAN_SETTINGS, mean_std, simulate  # noqa: E402  (a sibling script, not a package)

if TYPE_CHECKING:
    from alignfl.fl_app.config import RunConfig

DEFAULT_OUT = HERE / "runs" / "matching"
STRATEGIES = ("fedavg", "matched", "fedma")
CLIENTS = (2, 5, 10, 20)
MERGE_CLIENTS = (2, 5)
MERGE_KEYS = ("average", "matched-weight", "matched-l1", "ensemble")
PAN_CLIENTS = 5
BASE = {"model": "small-mlp", "dataset": "fashion-mnist", "partitioner": "dirichlet", "dirichlet-alpha": 0.5}


def fedma_cycle(model: str, dataset: str) -> int:
    """Communications per FedMA cycle: one per permutation group plus one for the output layer."""
    from alignfl.core.data import dataset_info
    from alignfl.models import build_model
    from alignfl.models.pan import PanSettings

    input_shape, num_classes = dataset_info(dataset)
    return len(build_model(model, input_shape, num_classes, PanSettings()).permutation_spec().groups) + 1


def planned_runs(seeds: list[int], clients: tuple[int, ...]) -> list[dict[str, Any]]:
    """Run-config overrides of every federated run, seeds outermost."""
    return [
        {**BASE, "strategy": strategy, "seed": seed, "_clients": k}
        for seed in seeds
        for k in clients
        for strategy in STRATEGIES
    ]


def run_name(run: dict[str, Any]) -> str:
    return f"{run['strategy']}__K{run['_clients']}__seed{run['seed']}"


def run_federated(args: argparse.Namespace, out: Path) -> None:
    cycle = fedma_cycle(BASE["model"], BASE["dataset"])
    if args.rounds % cycle:
        raise SystemExit(
            f"--rounds must be a multiple of the FedMA cycle ({cycle} communications for "
            f"{BASE['model']}), got {args.rounds}"
        )
    for run in planned_runs(args.seeds, tuple(args.clients)):
        name = run_name(run)
        if (out / name / "summary.json").exists():
            continue
        started = time.time()
        simulate(run, {"clients": run["_clients"], "fraction": 1.0, "rounds": args.rounds}, out, name)
        print(f"[matching-experiment] {name} done in {time.time() - started:.0f} s", flush=True)


def run_merges(args: argparse.Namespace, out: Path) -> None:
    from alignfl.fl_app.analysis.__main__ import main as analysis

    for seed in args.seeds:
        for k in MERGE_CLIENTS:
            folder = out / f"merge__K{k}__seed{seed}"
            if (folder / "merge.json").exists():
                continue
            started = time.time()
            status = analysis(
                [
                    "merge",
                    "--model",
                    BASE["model"],
                    "--dataset",
                    BASE["dataset"],
                    "--clients",
                    str(k),
                    "--init",
                    "different",
                    "--epochs",
                    str(args.merge_epochs),
                    "--dirichlet-alpha",
                    str(BASE["dirichlet-alpha"]),
                    "--seed",
                    str(seed),
                    "--device",
                    "cpu",
                    "--out",
                    str(folder),
                ]
            )
            if status:
                raise SystemExit(f"merge K={k} seed={seed} failed with status {status}")
            print(f"[matching-experiment] merge K={k} seed {seed} done in {time.time() - started:.0f} s", flush=True)


def pan_measurement(config: RunConfig, init: str) -> dict[str, Any]:
    """Train ``PAN_CLIENTS`` models, align clients 1.. onto client 0 (``weight`` cost) and measure what it does.

    ``moved``: share of hidden units the matching reorders. ``aligned-client-change``:
    mean change of a client's own test accuracy when its units are reordered (zero
    without PANs: the permutation preserves its function; with PANs the encodings
    stay at their positions, so it need not). Plus the plain and matched averages.
    """
    import torch

    from alignfl.core.merging.alignment import find_permutations
    from alignfl.core.model_io import build_run_model
    from alignfl.core.training.sgd import evaluate
    from alignfl.fl_app.analysis.merge import matched_keys, strategy_merge, train_clients
    from alignfl.models import permute_state

    device = torch.device("cpu")
    states, counts, dataset, _ = train_clients(config, PAN_CLIENTS, init == "same", device)
    model = build_run_model(config, dataset)
    spec = model.permutation_spec()

    def accuracy(state: Any) -> float:
        model.load_state_dict(state)
        return evaluate(model, dataset.test_x, dataset.test_y, device)[1]

    def merged(strategy: str, keys: dict[str, Any]) -> float:
        """The accuracy of ``strategy``'s own merge onto client 0, as round 1 of a run merges."""
        merge = strategy_merge(config, model, strategy, keys, states, counts, states[0])
        return accuracy(merge.arrays.to_torch_state_dict())

    perms = [find_permutations(states[0], state, spec) for state in states[1:]]
    moved = [sum(int((p != torch.arange(len(p))).sum()) for p in found.values()) for found in perms]
    units = sum(len(p) for p in perms[0].values())
    change = [accuracy(permute_state(spec, state, found)) - accuracy(state) for state, found in zip(states[1:], perms)]
    return {
        "init": init,
        "pan": config.pan_signature(),
        "seed": config.seed,
        "moved": statistics.mean(moved) / units,
        "aligned-client-change": statistics.mean(change),
        "average": merged("fedavg", {}),
        "matched-weight": merged("matched", matched_keys("weight", 1)),
    }


def run_pan(args: argparse.Namespace, out: Path) -> None:
    from alignfl.fl_app.config import parse_run_config

    for seed in args.seeds:
        for init in ("same", "different"):
            for pan, keys in PAN_SETTINGS.items():
                path = out / f"pan__{init}__{pan.replace(' ', '_').replace('=', '')}__seed{seed}.json"
                if path.exists():
                    continue
                config = parse_run_config(
                    {**BASE, **keys, "local-epochs": args.pan_epochs, "seed": seed, "device": "cpu"}
                )
                result = {**pan_measurement(config, init), "pan-name": pan, "epochs": args.pan_epochs}
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=2) + "\n")
                print(f"[matching-experiment] {path.name}: {result}", flush=True)


# --- report -----------------------------------------------------------------------------


def _federated_groups(out: Path, seeds: list[int]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(strategy, K) -> one dict per finished seed: its summary plus its per-round accuracies."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for summary_path in sorted(out.glob("*__K*__seed*/summary.json")):
        strategy, k, seed = summary_path.parent.name.split("__")
        if int(seed.removeprefix("seed")) not in seeds:
            continue
        rows = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads(summary_path.read_text())
        summary["curve"] = {row["round"]: row["accuracy"] for row in rows}
        groups.setdefault((strategy, int(k.removeprefix("K"))), []).append(summary)
    return groups


def federated_table(groups: dict[tuple[str, int], list[dict[str, Any]]], cycle: int) -> str:
    """Accuracy after every completed FedMA cycle (equal communications), one row per K and strategy."""
    rounds = sorted({r for runs in groups.values() for run in runs for r in run["curve"] if r and r % cycle == 0})
    header = " | ".join(f"after {r} comms (%)" for r in rounds)
    lines = [
        f"| K | strategy | seeds | {header} | best of all rounds (%) | run time (s) |",
        "|---|---|---|" + "---|" * (len(rounds) + 2),
    ]
    for k in sorted({k for _, k in groups}):
        for strategy in STRATEGIES:
            runs = groups.get((strategy, k), [])
            if not runs:
                continue
            cells = " | ".join(mean_std([run["curve"][r] for run in runs if r in run["curve"]]) for r in rounds)
            wall = statistics.mean(run["wall-time-s"] for run in runs)
            lines.append(
                f"| {k} | {strategy} | {len(runs)} | {cells} | "
                f"{mean_std([run['best-accuracy'] for run in runs])} | {wall:.0f} |"
            )
    return "\n".join(lines)


def _merge_groups(out: Path, seeds: list[int]) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("merge__K*__seed*/merge.json")):
        payload = json.loads(path.read_text())
        if payload["seed"] in seeds:
            groups.setdefault(payload["clients"], []).append(payload)
    return groups


def merge_table(groups: dict[int, list[dict[str, Any]]]) -> str:
    lines = [
        "| K | seeds | best client (%) | mean client (%) | " + " | ".join(f"{m} (%)" for m in MERGE_KEYS) + " |",
        "|---|---|---|---|" + "---|" * len(MERGE_KEYS),
    ]
    for k, runs in sorted(groups.items()):
        cells = " | ".join(mean_std([r["merged-accuracy"][m] for r in runs]) for m in MERGE_KEYS)
        lines.append(
            f"| {k} | {len(runs)} | {mean_std([max(r['client-accuracy']) for r in runs])} | "
            f"{mean_std([statistics.mean(r['client-accuracy']) for r in runs])} | {cells} |"
        )
    return "\n".join(lines)


def pan_table(out: Path, seeds: list[int]) -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(out.glob("pan__*.json")):
        result = json.loads(path.read_text())
        if result["seed"] in seeds:
            groups.setdefault((result["init"], result["pan-name"]), []).append(result)
    lines = [
        "| init | PANs | seeds | units moved (%) | client accuracy change when reordered (points) | "
        "plain average (%) | matched average (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (init, pan), runs in sorted(groups.items()):
        lines.append(
            f"| {init} | {pan} | {len(runs)} | {mean_std([r['moved'] for r in runs])} | "
            f"{mean_std([r['aligned-client-change'] for r in runs])} | "
            f"{mean_std([r['average'] for r in runs])} | {mean_std([r['matched-weight'] for r in runs])} |"
        )
    return "\n".join(lines)


def _plot(groups: dict[tuple[str, int], list[dict[str, Any]]], rounds: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in STRATEGIES:
        points = sorted(
            (k, [run["curve"][rounds] for run in runs if rounds in run["curve"]])
            for (s, k), runs in groups.items()
            if s == strategy
        )
        points = [(k, values) for k, values in points if values]
        if not points:
            continue
        ks = [k for k, _ in points]
        means = [100 * statistics.mean(v) for _, v in points]
        stds = [100 * statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in points]
        ax.errorbar(ks, means, yerr=stds, marker="o", capsize=3, label=strategy)
    ax.set(
        xscale="log",
        xlabel="number of clients K",
        ylabel=f"test accuracy after {rounds} comms (%)",
        title="Fashion-MNIST, small-mlp, Dirichlet 0.5: equal communication",
    )
    ax.minorticks_off()
    ax.set_xticks(list(CLIENTS), [str(k) for k in CLIENTS])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, seeds: list[int], rounds: int, figure: Path) -> str:
    groups = _federated_groups(out, seeds)
    _plot(groups, rounds, figure)
    cycle = fedma_cycle(BASE["model"], BASE["dataset"])
    return (
        federated_table(groups, cycle)
        + "\n\n"
        + merge_table(_merge_groups(out, seeds))
        + "\n\n"
        + pan_table(out, seeds)
        + f"\n\n(plot: {figure})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("federated", "merge", "pan"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="client counts K")
    parser.add_argument("--rounds", type=int, default=10, help="communications per run (a multiple of the cycle)")
    parser.add_argument("--merge-epochs", type=int, default=5, help="local epochs of each merged model")
    parser.add_argument("--pan-epochs", type=int, default=1, help="local epochs of each model in --part pan")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "matching_clients.png")
    parser.add_argument("--report", action="store_true", help="aggregate the finished runs and exit")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.report:
        print(report(out, args.seeds, args.rounds, args.figure))
    elif args.part == "federated":
        run_federated(args, out)
    elif args.part == "merge":
        run_merges(args, out)
    elif args.part == "pan":
        run_pan(args, out)
    else:
        parser.error("--part is required unless --report is given")


if __name__ == "__main__":
    main()
