"""FedAvg (VGG-9) versus grouped Ψ-Net averaging (psi-vgg9) in pathological N x C settings.

Yu et al., "Fed2: Feature-Aligned Federated Learning", KDD 2021, Table 1 / Figs. 5 and 7 at CPU
scale. Four parts, each a grid of runs over seeds:

* ``settings``: FedAvg on plain ``vgg9`` and ``psinet`` on ``psi-vgg9`` in 10x3, 10x5
  and 10x10 (clients x classes per client, pathological split);
* ``ablation`` (Fed2's Fig. 5, at 10x5): FedAvg on ``vgg9-bn`` and ``vgg9-gn``; the
  paper's other two bars, FedAvg without a norm and Ψ-Net with GroupNorm, are the
  ``settings`` part's 10x5 runs;
* ``scaling``: the same two methods with 20 and 50 clients x 5 classes (10x5 is in
  ``settings``). It runs last within a seed because it costs the most.
* ``architecture``: FedAvg on ``psi-vgg9`` itself (every client trains and sends every
  group) in 10x3, 10x5 and 10x10, so that the grouped architecture and the grouped
  aggregation can be told apart (not in the paper).

Each run is one experiment with the product's ServerApp/ClientApp (clients in
this process by default, see :func:`simulate`), writing its run folder under ``--out``; a run whose folder holds ``summary.json`` is
skipped (after checking its config equals the planned one), so the script can be
stopped and resumed. Seeds are the outer loop. ``--report`` writes ``results.md``
(mean ± sample std over seeds) and ``psinet_*.png`` from the run folders.

    python -m benchmarks.psinet.run --part settings ablation scaling --seeds 0 1 2 --width-factor 0.125 \\
        --data-fraction 0.05 --rounds 8 --local-epochs 1 --batch-size 32 --lr 0.01 --init he \\
        --test-per-class 300 --eval-clients-per-round 10
    python -m benchmarks.psinet.run --report --seeds 0 1 2 --figures benchmarks/figures

(the scale of benchmarks/RESULTS.md's section; the defaults of the options are that scale too).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "runs" / "psinet"

METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg", "model": "vgg9"},
    "psinet": {"strategy": "psinet", "model": "psi-vgg9"},
    "fedavg-bn": {"strategy": "fedavg", "model": "vgg9-bn"},
    "fedavg-gn": {"strategy": "fedavg", "model": "vgg9-gn"},
    "fedavg-psi": {"strategy": "fedavg", "model": "psi-vgg9"},
}
PARTS: dict[str, list[tuple[int, int, str]]] = {
    "settings": [(10, c, m) for c in (3, 5, 10) for m in ("fedavg", "psinet")],
    "ablation": [(10, 5, m) for m in ("fedavg-bn", "fedavg-gn")],
    "scaling": [(n, 5, m) for n in (20, 50) for m in ("fedavg", "psinet")],
    "architecture": [(10, c, "fedavg-psi") for c in (3, 5, 10)],
}
COMPARED = list(dict.fromkeys((n, c) for part in ("settings", "scaling") for n, c, _ in PARTS[part]))
"""The (clients, classes) settings of the FedAvg-versus-Ψ-Net table."""
ABLATION_ROWS = [
    ("fedavg", "FedAvg, no norm"),
    ("fedavg-bn", "FedAvg + BN"),
    ("fedavg-gn", "FedAvg + GN"),
    ("psinet", "Ψ-Net (BN shared, GN grouped)"),
]
COLORS = {
    "fedavg": "tab:blue",
    "psinet": "tab:orange",
    "fedavg-bn": "tab:green",
    "fedavg-gn": "tab:red",
    "fedavg-psi": "tab:purple",
}


def prepare_data(out: Path, test_per_class: int) -> str:
    """A ``data-root`` whose Fashion-MNIST has the official training split and the first ``test_per_class``
    test images of every class (file order, no randomness); 0 keeps the whole test split (no folder).

    Why: the server scores the global model on the test split every round, which on
    this CPU costs more than the clients' training at the scale used here.
    """
    if test_per_class == 0:
        return ""
    from alignfl.core.data.sources import DEBIAN_FASHION_MNIST_DIR, _read_idx

    raw = out / f"data-test{test_per_class}" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        link = raw / f"{stem}.gz"
        if not link.exists():
            link.symlink_to(DEBIAN_FASHION_MNIST_DIR / f"{stem}.gz")
    images = _read_idx(DEBIAN_FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz")
    labels = _read_idx(DEBIAN_FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")
    keep = np.sort(np.concatenate([np.flatnonzero(labels == c)[:test_per_class] for c in range(10)]))
    for stem, array in (("t10k-images-idx3-ubyte", images[keep]), ("t10k-labels-idx1-ubyte", labels[keep])):
        header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        (raw / f"{stem}.gz").write_bytes(gzip.compress(header + array.tobytes(), mtime=0))
    return str(raw.parent.parent)


def run_name(clients: int, classes: int, method: str, seed: int) -> str:
    return f"{clients}x{classes}__{method}__seed{seed}"


def planned(parts: list[str], seeds: list[int]) -> list[tuple[int, int, str, int]]:
    """Every (clients, classes, method, seed), seeds outermost, without duplicates."""
    runs = [(n, c, m, s) for s in seeds for part in parts for n, c, m in PARTS[part]]
    return list(dict.fromkeys(runs))


def overrides(clients: int, classes: int, method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The run config of one run (the shared scale settings from ``args``)."""
    fraction = min(1.0, args.clients_per_round / clients) if args.clients_per_round else 1.0
    evaluated = min(1.0, args.eval_clients_per_round / clients) if args.eval_clients_per_round else 1.0
    return {
        **METHODS[method],
        "dataset": args.dataset,
        "partitioner": "pathological",
        "classes-per-client": classes,
        "num-server-rounds": args.rounds,
        "local-epochs": args.local_epochs,
        "lr": args.lr,
        "batch-size": args.batch_size,
        "width-factor": args.width_factor,
        "init": args.init,
        "data-fraction": args.data_fraction,
        "fraction-train": fraction,
        "fraction-evaluate": evaluated,
        "min-available-nodes": clients,
        "seed": seed,
        "results-dir": str(args.out),
        "data-root": args.data_root,
        "run-name": run_name(clients, classes, method, seed),
        **({"psi-depth": args.psi_depth} if METHODS[method]["model"].startswith("psi-") else {}),
    }


def finished(folder: Path, config: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished run of exactly ``config`` (a different one is an error)."""
    if not (folder / "summary.json").exists():
        return False
    stored = json.loads((folder / "config.json").read_text())
    differs = {k: (stored.get(k), v) for k, v in config.items() if stored.get(k) != v}
    if differs:
        raise SystemExit(
            f"{folder} holds a finished run with other settings {differs} (stored, planned); use another --out"
        )
    return True


def simulate(config: dict[str, Any], clients: int, backend: str) -> None:
    """One run with the product's ServerApp and ClientApp, in this process or on Ray.

    ``inprocess`` (the default) is :func:`alignfl.fl_app.inprocess.run_in_process`, clients one after another. Why
    not Ray by default: every run starts fresh actor processes that import torch and Flower and load the
    data again, about two minutes per run on this loaded 2-core machine (measured: round 1 took 123-151 s,
    round 2 9-23 s), which is more than the training. ``ray`` is Flower's simulation runtime on a private
    local SuperLink, as the launcher and the sweep run it. Accuracy is what is measured, and both run the same
    apps and round runner (which samples clients in partition order on every engine).
    """
    from alignfl.fl_app.config import parse_run_config
    from alignfl.fl_app.sweeps.sim import SimSettings
    from alignfl.fl_app.sweeps.sweep import simulate as run_simulation

    run_simulation(parse_run_config(config), SimSettings(backend=backend, num_supernodes=clients))


def run_all(args: argparse.Namespace) -> None:
    args.data_root = prepare_data(args.out, args.test_per_class) if args.dataset == "fashion-mnist" else ""
    runs = planned(args.part, args.seeds)
    for i, (clients, classes, method, seed) in enumerate(runs, 1):
        config = overrides(clients, classes, method, seed, args)
        folder = args.out / config["run-name"]
        if finished(folder, config):
            print(f"[{i}/{len(runs)}] {folder.name}: done, skipped", flush=True)
            continue
        started = time.time()
        simulate(config, clients, args.backend)
        summary = json.loads((folder / "summary.json").read_text())
        print(
            f"[{i}/{len(runs)}] {folder.name}: final {summary['final-accuracy']:.4f}, {time.time() - started:.0f} s",
            flush=True,
        )


# --- report ---------------------------------------------------------------------------


def load(out: Path, clients: int, classes: int, method: str, seeds: list[int]) -> list[dict[str, Any]]:
    """Summaries (plus the per-round rows) of the finished seeds of one configuration."""
    found = []
    for seed in seeds:
        folder = out / run_name(clients, classes, method, seed)
        if (folder / "summary.json").exists():
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            found.append({**json.loads((folder / "summary.json").read_text()), "rows": rows})
    return found


def mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{100 * values[0]:.2f}"
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def _cells(runs: list[dict[str, Any]]) -> str:
    return (
        f"{len(runs)} | {mean_std([r['final-accuracy'] for r in runs])} | "
        f"{mean_std([r['last-5-mean-accuracy'] for r in runs])} | {mean_std([r['best-accuracy'] for r in runs])}"
    )


def comparison_table(out: Path, seeds: list[int], baseline: str, settings: list[tuple[int, int]]) -> str:
    """``baseline`` against ``psinet`` per (clients, classes) setting, with the paired per-seed gap."""
    lines = [
        f"| N×C | method | model | seeds | final acc % | last-5 mean acc % | best acc % | Ψ − {baseline} (final) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for clients, classes in settings:
        runs = {m: load(out, clients, classes, m, seeds) for m in (baseline, "psinet")}
        if not any(runs.values()):
            continue
        for method, found in runs.items():
            gap = ""
            if method == "psinet" and runs[baseline] and found:
                paired = _paired_gaps(runs[baseline], found)
                gap = mean_std(paired) if paired else ""
            lines.append(f"| {clients}×{classes} | {method} | {METHODS[method]['model']} | {_cells(found)} | {gap} |")
    return "\n".join(lines) + "\n"


def _paired_gaps(baseline: list[dict[str, Any]], psinet: list[dict[str, Any]]) -> list[float]:
    """Ψ-Net minus the baseline's final accuracy, per seed both finished."""
    by_seed = {Path(r["run-folder"]).name.rsplit("seed", 1)[1]: r["final-accuracy"] for r in baseline}
    return [
        r["final-accuracy"] - by_seed[s]
        for r in psinet
        if (s := Path(r["run-folder"]).name.rsplit("seed", 1)[1]) in by_seed
    ]


def ablation_table(out: Path, seeds: list[int]) -> str:
    lines = ["| 10×5 | model | seeds | final acc % | last-5 mean acc % | best acc % |", "|---|---|---|---|---|---|"]
    for method, label in ABLATION_ROWS:
        lines.append(f"| {label} | {METHODS[method]['model']} | {_cells(load(out, 10, 5, method, seeds))} |")
    return "\n".join(lines) + "\n"


def plot(out: Path, seeds: list[int], folder: Path) -> list[Path]:
    """Mean global accuracy versus round per setting, and the ablation; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = COMPARED
    fig, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings), 3.2), sharey=True)
    for ax, (clients, classes) in zip(axes, settings):
        for method in ("fedavg", "psinet"):
            _curve(ax, load(out, clients, classes, method, seeds), method, COLORS[method])
        ax.set(title=f"{clients}×{classes}", xlabel="round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("global test accuracy")
    axes[0].legend(
        handles=[
            plt.Line2D([], [], color=COLORS[m], label=f"{m} ({METHODS[m]['model']})") for m in ("fedavg", "psinet")
        ],
        loc="upper left",
        fontsize=8,
    )
    fig.tight_layout()
    paths = [folder / "psinet_settings.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, label in ABLATION_ROWS:
        _curve(ax, load(out, 10, 5, method, seeds), label, COLORS[method])
    ax.set(title="normalisation ablation, 10×5", xlabel="round", ylabel="global test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(folder / "psinet_norm_ablation.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def _curve(ax: Any, runs: list[dict[str, Any]], label: str, color: str) -> None:
    """Mean over seeds with a ±1 std band."""
    if not runs:
        return
    rounds = [row["round"] for row in runs[0]["rows"]]
    acc = [[row["accuracy"] for row in r["rows"]] for r in runs]
    mean = [statistics.mean(column) for column in zip(*acc)]
    std = [statistics.stdev(column) if len(column) > 1 else 0.0 for column in zip(*acc)]
    ax.plot(rounds, mean, marker=".", label=label, color=color)
    ax.fill_between(
        rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2, color=color
    )


def report(args: argparse.Namespace) -> None:
    figures = args.figures or args.out
    figures.mkdir(parents=True, exist_ok=True)
    text = (
        "## N×C settings and node scaling\n\n"
        + comparison_table(args.out, args.seeds, "fedavg", COMPARED)
        + "\n## Normalisation ablation\n\n"
        + ablation_table(args.out, args.seeds)
        + "\n## Same architecture (psi-vgg9): FedAvg versus grouped averaging\n\n"
        + comparison_table(args.out, args.seeds, "fedavg-psi", [(10, c) for c in (3, 5, 10)])
    )
    paths = plot(args.out, args.seeds, figures)
    (args.out / "results.md").write_text(text)
    print(text)
    print("figures:", *paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", default=["settings", "ablation", "scaling"], choices=list(PARTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width-factor", type=float, default=0.125)
    parser.add_argument("--data-fraction", type=float, default=0.05)
    parser.add_argument(
        "--clients-per-round",
        type=int,
        default=0,
        help="train this many sampled clients per round (0: all); sets fraction-train",
    )
    parser.add_argument(
        "--eval-clients-per-round",
        type=int,
        default=10,
        help="score the global model on this many sampled clients' local test splits per round "
        "(0: all); sets fraction-evaluate",
    )
    parser.add_argument("--psi-depth", type=int, default=2)
    parser.add_argument("--init", default="he", help="run-config init (he: plain VGG-9 trains at this scale)")
    parser.add_argument(
        "--test-per-class",
        type=int,
        default=300,
        help="Fashion-MNIST: score the global model on the first K test images of each class (0: all 10,000)",
    )
    parser.add_argument(
        "--backend",
        choices=["inprocess", "ray"],
        default="inprocess",
        help="where clients run: this process, one after another (default), or Ray actors",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="absolute results folder")
    parser.add_argument("--report", action="store_true", help="only write the tables and plots")
    parser.add_argument("--figures", type=Path, default=None, help="where the plots go (default: --out)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    report(args) if args.report else run_all(args)


if __name__ == "__main__":
    main()
