"""PANs off versus on, under FedAvg across Dirichlet α and under five algorithms at small α.

Li et al., "Federated Learning with Position-Aware Neurons", CVPR 2022.

Each run is one experiment on the in-process engine (:func:`alignfl.fl_app.inprocess.run_in_process`: the ServerApp's
round runner and the ClientApp that ``flwr run`` runs, clients one after another in this process, no Ray)
writing its own run folder; accuracy is what is measured here, not Flower's runtime, and the engine gives the
rows Flower's simulation gives (it samples clients in partition order as every engine does). Finished runs
are skipped, so the script can be stopped and resumed. ``--report`` turns the run folders into a
Markdown table (mean ± std over seeds of the final accuracy and of the best
accuracy over the last 5 rounds) and a plot.

    python benchmarks/pan_experiment.py --part alpha --seeds 0 1 2
    python benchmarks/pan_experiment.py --part algorithms --seeds 0 1 2
    python benchmarks/pan_experiment.py --report --seeds 0 1 2

``--part authors``: FedAvg with PANs off / mul T=1 A=0.1 / add T=1 A=0.15 in the PANs authors' own
training setting (their code: batch 64, SGD lr 0.05 momentum 0.9 weight decay 1e-5, a 10-round linear lr
warm-up, the server's unweighted mean of the client models) on the MLP, Dirichlet 0.1, 10 clients all taking
part, E = 2, 30 rounds; each final model then gets the shuffle test (P_sf = 1: every hidden layer fully
permuted), which PANs should make costly:

    python benchmarks/pan_experiment.py --part authors --seeds 0 1 2 --rounds 30 --train-size 3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "runs" / "pan"

PAN_SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"pan-mode": "off", "pan-t": 1.0, "pan-a": 0.0},
    "mul T=1 A=0.1": {"pan-mode": "mul", "pan-t": 1.0, "pan-a": 0.1},
    "add T=1 A=0.15": {"pan-mode": "add", "pan-t": 1.0, "pan-a": 0.15},
}
ALPHAS = (0.1, 1.0, 10.0)
ALGORITHMS = ("fedavg", "fedprox", "fedavgm", "scaffold", "moon")
AUTHORS: dict[str, Any] = {
    "local-epochs": 2,
    "batch-size": 64,
    "lr": 0.05,
    "momentum": 0.9,
    "weight-decay": 1e-5,
    "lr-warmup-rounds": 10,
    "server-weighting": "uniform",
}
"""The PANs authors' training setting (their code, github.com/lxcnju/FedPAN)."""
SHUFFLE_P_SF = (0.5, 1.0)
ALGORITHM_SETTINGS: dict[str, dict[str, Any]] = {"scaffold": {"momentum": 0.0}}
"""Per-algorithm overrides of the shared scale. SCAFFOLD runs plain SGD, as in its paper: with the shared
momentum 0.9 at lr 0.05 it diverged here (seed 0, α = 0.1: final accuracy 10 % with PANs off, 29 % on)."""


def planned_runs(part: str, seeds: list[int]) -> list[dict[str, Any]]:
    """The grid of one part, as run-config overrides (without the shared scale settings).

    Seeds are the outer loop and PAN settings the inner one, so a stopped run still
    leaves complete off/on comparisons for the seeds it finished.
    """
    if part == "authors":
        return [
            {
                "strategy": "fedavg",
                "dirichlet-alpha": 0.1,
                "seed": seed,
                **PAN_SETTINGS[pan],
                **AUTHORS,
                "_pan": pan,
                "_part": part,
            }
            for seed in seeds
            for pan in PAN_SETTINGS
        ]
    if part == "alpha":
        grid = [("fedavg", pan, alpha) for alpha in ALPHAS for pan in PAN_SETTINGS]
    else:
        grid = [(algo, pan, 0.1) for algo in ALGORITHMS for pan in ("off", "mul T=1 A=0.1")]
    return [
        {
            "strategy": algo,
            "dirichlet-alpha": alpha,
            "seed": seed,
            **PAN_SETTINGS[pan],
            **ALGORITHM_SETTINGS.get(algo, {}),
            "_pan": pan,
        }
        for seed in seeds
        for algo, pan, alpha in grid
    ]


def run_name(run: dict[str, Any]) -> str:
    pan = run["_pan"].replace(" ", "_").replace("=", "")
    prefix = "authors__" if run.get("_part") == "authors" else ""
    return f"{prefix}{run['strategy']}__{pan}__alpha{run['dirichlet-alpha']}__seed{run['seed']}"


def shuffle_final_model(folder: Path) -> None:
    """The shuffle test of a run's final model (``shuffle.json`` beside it): error on Gaussian inputs and the
    test-accuracy change when every hidden layer is permuted with disorder P_sf (3 draws each)."""
    from alignfl.fl_app.analysis.common import load_run_model
    from alignfl.fl_app.analysis.shuffle import gaussian_inputs, shuffle_test

    loaded = load_run_model(folder)
    data = loaded.dataset
    inputs = gaussian_inputs(data.input_shape, 64, 0)
    outcomes = {
        str(p): shuffle_test(loaded.model, p, inputs, repeats=3, seed=0, test_data=(data.test_x, data.test_y))
        for p in SHUFFLE_P_SF
    }
    (folder / "shuffle.json").write_text(json.dumps({p: vars(o) for p, o in outcomes.items()}, indent=2) + "\n")


def simulate(run: dict[str, Any], scale: dict[str, Any], out: Path, name: str | None = None) -> None:
    """One run with the product's apps on the in-process engine.

    ``run`` holds run-config overrides (keys starting with ``_`` are labels, not sent),
    which win over ``scale``'s; the run folder is ``out / name`` (default: :func:`run_name`).
    """
    from alignfl.fl_app.inprocess import run_in_process

    overrides = {
        "num-server-rounds": scale["rounds"],
        "results-dir": str(out),
        "run-name": name or run_name(run),
        "fraction-train": scale["fraction"],
        "fraction-evaluate": scale["fraction"],
    }
    overrides.update({k: v for k, v in run.items() if not k.startswith("_")})  # a run's own keys win
    run_in_process(overrides, scale["clients"])  # sets min-available-nodes to the clients


def mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * std:.2f}"


def report(out: Path, seeds: list[int]) -> str:
    """Markdown table over the finished runs of ``seeds``, one row per (algorithm, PANs, α), with each PAN
    setting's final accuracy minus PANs off, paired by seed (same split, same initial model)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for summary_path in sorted(out.glob("*/summary.json")):
        if summary_path.parent.name.startswith("authors__"):
            continue  # authors_report's
        config = json.loads((summary_path.parent / "config.json").read_text())
        if config["seed"] not in seeds:
            continue
        pan = next(name for name, keys in PAN_SETTINGS.items() if all(config[k] == v for k, v in keys.items()))
        key = (config["strategy"], pan, config["dirichlet-alpha"])
        groups.setdefault(key, []).append({**json.loads(summary_path.read_text()), "seed": config["seed"]})
    lines = [
        "| algorithm | PANs | α | seeds | final accuracy (%) | best of last 5 rounds (%) | PANs − off, final (points) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (algo, pan, alpha), runs in sorted(groups.items()):
        off = {r["seed"]: r["final-accuracy"] for r in groups.get((algo, "off", alpha), [])}
        paired = [r["final-accuracy"] - off[r["seed"]] for r in runs if r["seed"] in off]
        gap = "" if pan == "off" else mean_std(paired)
        lines.append(
            f"| {algo} | {pan} | {alpha} | {len(runs)} | "
            f"{mean_std([r['final-accuracy'] for r in runs])} | "
            f"{mean_std([r['last-5-best-accuracy'] for r in runs])} | {gap} |"
        )
    _plot(groups, out / "pan_experiment.png")
    return "\n".join(lines)


def authors_report(out: Path, seeds: list[int]) -> str:
    """The ``authors`` part: final accuracy per PAN setting and the shuffle test of the final models."""
    rows: dict[str, list[dict[str, Any]]] = {pan: [] for pan in PAN_SETTINGS}
    for pan in PAN_SETTINGS:
        for seed in seeds:
            folder = out / run_name(
                {"strategy": "fedavg", "_pan": pan, "_part": "authors", "dirichlet-alpha": 0.1, "seed": seed}
            )
            if (folder / "shuffle.json").exists():
                rows[pan].append(
                    {
                        **json.loads((folder / "summary.json").read_text()),
                        "shuffle": json.loads((folder / "shuffle.json").read_text()),
                    }
                )
    header = " | ".join(f"P_sf={p:g}: error (Eq. 8) | P_sf={p:g}: accuracy change (points)" for p in SHUFFLE_P_SF)
    lines = [f"| PANs | seeds | final accuracy (%) | {header} |", "|---|---|---|" + "---|---|" * len(SHUFFLE_P_SF)]
    for pan, runs in rows.items():
        if not runs:
            continue
        cells = []
        for p in SHUFFLE_P_SF:
            errors = [r["shuffle"][str(p)]["error"] for r in runs]
            changes = [r["shuffle"][str(p)]["accuracy_change"] for r in runs]
            cells += [
                f"{statistics.mean(errors):.3g} ± {statistics.stdev(errors) if len(errors) > 1 else 0:.2g}",
                mean_std(changes),
            ]
        lines.append(
            f"| {pan} | {len(runs)} | {mean_std([r['final-accuracy'] for r in runs])} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _plot(groups: dict[tuple[str, str, float], list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pan in PAN_SETTINGS:
        points = sorted(
            (alpha, statistics.mean(r["last-5-best-accuracy"] for r in runs))
            for (algo, p, alpha), runs in groups.items()
            if algo == "fedavg" and p == pan
        )
        if points:
            ax.plot(*zip(*points), marker="o", label=f"FedAvg, PANs {pan}")
    ax.set(
        xscale="log",
        xlabel="Dirichlet α",
        ylabel="best accuracy of last 5 rounds",
        title="FedAvg on Fashion-MNIST (MLP): PANs off vs on",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("alpha", "algorithms", "authors"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=1.0, help="fraction of clients per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-size", type=int, default=0, help="training images used (0: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true", help="aggregate the finished runs and exit")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.report:
        print(report(out, args.seeds))
        print(authors_report(out, args.seeds))
        return
    if args.part is None:
        parser.error("--part is required unless --report is given")
    scale = {"clients": args.clients, "fraction": args.fraction, "rounds": args.rounds}
    for run in planned_runs(args.part, args.seeds):
        if args.train_size:
            run = {**run, "train-size": args.train_size}
        folder = out / run_name(run)
        trained = (folder / "summary.json").exists()
        if trained and (args.part != "authors" or (folder / "shuffle.json").exists()):
            continue
        started = time.time()
        if not trained:
            simulate(run, scale, out)
        if args.part == "authors":
            shuffle_final_model(folder)
        print(f"[pan-experiment] {run_name(run)} done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
