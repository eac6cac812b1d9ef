"""SuPerFed against FedAvg, FedProx, FedPer and Ditto under a pathological split, and under label noise.

Hahn, Jeong and Lee, "Connecting Low-Loss Subspace for Personalized Federated Learning", KDD 2022,
Table 1 (pathological non-IID, TwoNN, K = 50) and Table 4 (label
noise, ECE/MCE), scaled down to this machine. ``--part pathological``: every
client holds 2 classes (the ``pathological`` partitioner), K trained clients, 10%
of them per round, plus ``--holdout`` partitions that never train and score the
global model each round as new clients. ``--part noise``: FedAvg against
SuPerFed-MM with pair or symmetric flipping of the clients' training labels, on
the same split (the paper's Table 4 uses Dirichlet α = 10; the same split lets
the clean runs of ``pathological`` serve as the noise-free rows). Each run is one experiment on the in-process
engine through :func:`pan_experiment.simulate`; finished runs are skipped, so
the script can be stopped and resumed; seeds are the outer loop. ``--report``
prints the Markdown tables and writes the plot of accuracy along λ.

    python benchmarks/superfed_experiment.py --part pathological --seeds 0 1 2
    python benchmarks/superfed_experiment.py --part noise --seeds 0
    python benchmarks/superfed_experiment.py --report --seeds 0 1 2

``--part authors``: the authors' own setting, scaled only in R: their fixed-pairs split (client k holds
classes {k//10, 5 + k//10} for K = 50), their bias-free TwoNN 784-200-200-200-10, K = 50 with 5 per round, E = 10,
B = 10, lr 0.01 decayed by 0.999 per round, mu = 0.01, the local model initialised as their code does, no held-out
clients; R = 50 instead of 500. SuPerFed-MM, SuPerFed-LM and FedAvg:

    python benchmarks/superfed_experiment.py --part authors --seeds 0 1 2 --rounds 50 --local-epochs 10 \
        --batch-size 10 --holdout 0 --evaluate-every 10

Deviations of ``pathological`` and ``noise`` from the paper (besides R, E, B and lr, scaled to a shared 2-core
machine): the split is flwr-datasets'
PathologicalPartitioner (client k holds class k mod 10 and a random second one),
not the authors' fixed pairs; TwoNN has biases; the partitions of the held-out
clients are carved from the same training set, so K + H partitions share it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pan_experiment import mean_std, simulate  # noqa: E402  (a sibling script, not a package)

DEFAULT_OUT = HERE / "runs" / "superfed"
LAMBDAS = tuple(i / 10 for i in range(11))

# The paper's settings (Appendix A) but for R, E, B and lr (command-line options).
COMMON: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "model": "twonn",
    "lr-decay": 0.999,
    "momentum": 0.9,
    "weight-decay": 1e-4,
    "test-fraction": 0.2,
    "fraction-evaluate": 1.0,
}
SUPERFED: dict[str, Any] = {"strategy": "superfed", "superfed-start": 0.4, "superfed-mu": 0.01}
PATHOLOGICAL: dict[str, Any] = {"partitioner": "pathological", "classes-per-client": 2}
AUTHORS: dict[str, Any] = {"partitioner": "fixed-pairs", "samples-per-client": 0, "hidden-layers": 3, "bias": False}
"""The SuPerFed authors' split and network (their code, github.com/vaseline555/SuPerFed); SuPerFed also starts its local
models as their code does (``superfed-local-init``)."""
AUTHORS_METHODS = ("SuPerFed-MM", "SuPerFed-LM", "FedAvg")
METHODS: dict[str, dict[str, Any]] = {  # the order runs go in: the main comparison first
    "SuPerFed-MM": {**SUPERFED, "superfed-mode": "mm", "superfed-nu": 1.0},
    "FedAvg": {"strategy": "fedavg"},
    "SuPerFed-LM": {**SUPERFED, "superfed-mode": "lm", "superfed-nu": 2.0},
    "Ditto": {"strategy": "ditto"},
    "FedPer": {"strategy": "fedper"},
    "FedProx": {"strategy": "fedprox", "fedprox-mu": 0.01},
}
NOISE: dict[str, dict[str, Any]] = {
    "pair 0.1": {"label-noise": "pair", "label-noise-rate": 0.1},
    "pair 0.4": {"label-noise": "pair", "label-noise-rate": 0.4},
    "symmetric 0.2": {"label-noise": "symmetric", "label-noise-rate": 0.2},
    "symmetric 0.6": {"label-noise": "symmetric", "label-noise-rate": 0.6},
}
NOISE_METHODS = ("FedAvg", "SuPerFed-MM")


def planned_runs(part: str, seeds: list[int], noise: list[str]) -> list[dict[str, Any]]:
    """Run-config overrides of one part; ``_method``, ``_noise`` and ``_part`` label a run (not sent)."""
    if part == "authors":
        local_init = {"superfed": {"superfed-local-init": "authors"}}
        return [
            {
                **COMMON,
                **AUTHORS,
                **METHODS[m],
                **local_init.get(METHODS[m]["strategy"], {}),
                "seed": seed,
                "_method": m,
                "_noise": "none",
                "_part": part,
            }
            for seed in seeds
            for m in AUTHORS_METHODS
        ]
    if part == "pathological":
        return [
            {**COMMON, **PATHOLOGICAL, **METHODS[m], "seed": seed, "_method": m, "_noise": "none", "_part": part}
            for seed in seeds
            for m in METHODS
        ]
    return [
        {**COMMON, **PATHOLOGICAL, **METHODS[m], **NOISE[n], "seed": seed, "_method": m, "_noise": n, "_part": part}
        for seed in seeds
        for n in noise
        for m in NOISE_METHODS
    ]


def run_name(run: dict[str, Any]) -> str:
    noise = run["_noise"].replace(" ", "")
    return f"{run['_part']}__{run['_method']}__{noise}__seed{run['seed']}"


def _finished(out: Path, part: str, seeds: list[int]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(method, noise) → the summaries of the finished runs of ``part`` for ``seeds``."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(out.glob(f"{part}__*/summary.json")):
        _, method, noise, seed = path.parent.name.split("__")
        if int(seed.removeprefix("seed")) in seeds:
            last = json.loads((path.parent / "metrics.jsonl").read_text().splitlines()[-1])
            groups.setdefault((method, noise), []).append({**json.loads(path.read_text()), "last-round": last})
    return groups


def _col(runs: list[dict[str, Any]], key: str) -> str:
    return mean_std([r[key] for r in runs if r.get(key) is not None])


def _personal_key(method: str, choice: str) -> str | None:
    """The summary key of a method's personalised accuracy (SuPerFed: the ``oracle`` or ``honest`` λ)."""
    strategy = METHODS[method]["strategy"]
    if strategy == "superfed":
        return f"final-{choice}-accuracy-mean"
    return "final-personal-accuracy-mean" if strategy in ("fedper", "ditto") else None


def _trained(runs: list[dict[str, Any]], method: str) -> str:
    """How many evaluated clients had trained their personal model by the end (mean over seeds)."""
    key = {
        "superfed": "superfed-local-trained-mean",
        "fedper": "personal-trained-mean",
        "ditto": "personal-trained-mean",
    }.get(METHODS[method]["strategy"])
    if key is None:
        return "—"
    counts = [r["last-round"][key] * r["last-round"]["clients-evaluated"] for r in runs]
    return f"{statistics.mean(counts):.1f} of {runs[0]['last-round']['clients-evaluated']}"


def pathological_table(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    lines = [
        "| method | seeds | global model, official test split | global model, clients' local test "
        "(mean) | personalised, clients' local test (mean) | SuPerFed oracle λ (test split) | "
        "new clients (global model) | clients with a trained personal model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        runs = groups.get((method, "none"), [])
        if not runs:
            continue
        personal = _personal_key(method, "honest")
        oracle = _personal_key(method, "oracle") if METHODS[method]["strategy"] == "superfed" else None
        lines.append(
            f"| {method} | {len(runs)} | {_col(runs, 'final-accuracy')} | "
            f"{_col(runs, 'final-local-accuracy-mean')} | "
            f"{_col(runs, personal) + (' (honest λ)' if oracle else '') if personal else '—'} | "
            f"{_col(runs, oracle) if oracle else '—'} | {_col(runs, 'final-new-client-accuracy')} | "
            f"{_trained(runs, method)} |"
        )
    return "\n".join(lines)


def lambda_table(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    lines = [
        "| method | " + " | ".join(f"λ={lam:g}" for lam in LAMBDAS) + " | honest λ (mean) |",
        "|---|" + "---|" * (len(LAMBDAS) + 1),
    ]
    for method in ("SuPerFed-MM", "SuPerFed-LM"):
        runs = groups.get((method, "none"), [])
        if runs:
            cells = [mean_std([r["final-lambda-accuracy-mean"][i] for r in runs]) for i in range(len(LAMBDAS))]
            honest = statistics.mean(r["final-honest-lambda-mean"] for r in runs)
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {honest:.2f} |")
    return "\n".join(lines)


def noise_table(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> str:
    """Accuracy, ECE and MCE on the clients' local test splits; ``none``: the clean pathological runs."""
    lines = [
        "| noise | method | seeds | model scored | accuracy (%) | ECE (%) | MCE (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for noise in ("none", *NOISE):
        for method in NOISE_METHODS:
            runs = groups.get((method, noise.replace(" ", "")), [])  # run names drop the space
            if not runs:
                continue
            scored = [("global", "final-local-accuracy-mean", "final-local-ece-mean", "final-local-mce-mean")]
            if METHODS[method]["strategy"] == "superfed":
                scored += [
                    (f"{c} λ", f"final-{c}-accuracy-mean", f"final-{c}-ece-mean", f"final-{c}-mce-mean")
                    for c in ("honest", "oracle")
                ]
            for label, *keys in scored:
                lines.append(
                    f"| {noise} | {method} | {len(runs)} | {label} | " + " | ".join(_col(runs, k) for k in keys) + " |"
                )
    return "\n".join(lines)


def plot_lambda(groups: dict[tuple[str, str], list[dict[str, Any]]], path: Path) -> None:
    """Mean personalised accuracy along λ for SuPerFed-MM/LM, with FedAvg's global model on the same splits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("SuPerFed-MM", "SuPerFed-LM"):
        runs = groups.get((method, "none"), [])
        if runs:
            means = [statistics.mean(r["final-lambda-accuracy-mean"][i] for r in runs) for i in range(len(LAMBDAS))]
            ax.plot(LAMBDAS, means, marker="o", label=f"{method} (mean over clients, {len(runs)} seeds)")
    for method, style in (("FedAvg", "--"), ("Ditto", ":")):
        runs = groups.get((method, "none"), [])
        key = "final-local-accuracy-mean" if method == "FedAvg" else "final-personal-accuracy-mean"
        if runs:
            ax.axhline(
                statistics.mean(r[key] for r in runs),
                linestyle=style,
                color="grey",
                label=f"{method} {'global' if method == 'FedAvg' else 'personal'} model",
            )
    ax.set(
        xlabel="λ (0: federated model, 1: local model)",
        ylabel="accuracy on the clients' local test splits",
        title="Fashion-MNIST, TwoNN, 2 classes per client",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, seeds: list[int], figure: Path) -> str:
    pathological = _finished(out, "pathological", seeds)
    noise = _finished(out, "noise", seeds)
    noise_seeds = {int(p.name.rpartition("seed")[2]) for p in out.glob("noise__*")}
    noise.update(
        {
            key: runs
            for key, runs in _finished(out, "pathological", sorted(noise_seeds)).items()
            if key[0] in NOISE_METHODS
        }
    )
    if pathological:
        plot_lambda(pathological, figure)
    tables = [pathological_table(pathological), lambda_table(pathological), noise_table(noise)]
    authors = _finished(out, "authors", seeds)
    if authors:
        plot_lambda(authors, figure.with_name(f"{figure.stem}_authors{figure.suffix}"))
        tables += ["Authors' setting (--part authors):", pathological_table(authors), lambda_table(authors)]
    return "\n\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("pathological", "noise", "authors"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=50, help="K, the clients that train")
    parser.add_argument("--holdout", type=int, default=5, help="new clients: never train, scored each round")
    parser.add_argument("--fraction", type=float, default=0.1, help="fraction of the K clients per round")
    parser.add_argument("--rounds", type=int, default=25, help="R (the paper: 500)")
    parser.add_argument("--local-epochs", type=int, default=5, help="E (the paper: 10)")
    parser.add_argument("--batch-size", type=int, default=50, help="B (the paper: 10)")
    parser.add_argument("--lr", type=float, default=0.01, help="client lr (the paper: 0.01 at B = 10)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), help="only these methods (default: the part's)")
    parser.add_argument(
        "--evaluate-every",
        type=int,
        default=1,
        help="clients evaluate every this many rounds and in the last (the tables read the last)",
    )
    parser.add_argument("--noise", nargs="+", choices=list(NOISE), default=["pair 0.4", "symmetric 0.6"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "superfed_lambda.png")
    parser.add_argument("--report", action="store_true", help="aggregate the finished runs and exit")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.report:
        print(report(out, args.seeds, args.figure.resolve()))
        return
    if args.part is None:
        parser.error("--part is required unless --report is given")
    scale = {"clients": args.clients + args.holdout, "fraction": args.fraction, "rounds": args.rounds}
    for run in planned_runs(args.part, args.seeds, args.noise):
        if args.methods and run["_method"] not in args.methods:
            continue
        run = {
            **run,
            "local-epochs": args.local_epochs,
            "batch-size": args.batch_size,
            "lr": args.lr,
            "holdout-clients": args.holdout,
            "evaluate-every": args.evaluate_every,
        }
        if (out / run_name(run) / "summary.json").exists():
            continue
        started = time.time()
        simulate(run, scale, out, run_name(run))
        print(f"[superfed-experiment] {run_name(run)} done in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
