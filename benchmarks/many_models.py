"""Merging many models at once: matching onto client 0 against the universe (C2M3), each without and with REPAIR.

The clients are ``one_shot.py``'s (its :func:`one_shot.run_config`: Fashion-MNIST, a fixed 3,200-image subset,
Dirichlet(alpha), E = 20, each client from its own initialisation, trained once per (network, K, seed) cell as round
1 of a one-shot run trains it). Each cell scores on the test split: the example-weighted average; weight matching
onto client 0, then averaged; the universe matching of all K models (Crisostomi et al., "C2M3: Cycle-Consistent
Multi-Model Merging", NeurIPS 2024; :mod:`alignfl.core.merging.universe`), then averaged; each merge again after REPAIR
(Jordan et al., "REPAIR: REnormalizing Permuted Activations for Interpolation Repair", ICLR 2023;
:func:`alignfl.fl_app.analysis.merge.repair_merge`) twice: with each client's model measured on its own training split
and the merged model on every client's, as ``repair=on`` measures them (``+ REPAIR``), and with every model measured on
the union of the clients' training splits, as REPAIR's authors measure on one data set (``+ REPAIR pooled``); the
ensemble (mean softmax) and the best client. It also records the cycle-consistency error that matching
onto client 0 has (per permutation group) and Frank-Wolfe's iterations and objective.

One JSON line per cell is appended to ``--out`` as soon as it is done (a cell already there is skipped, so a
killed run goes on); ``--report`` prints the markdown tables and draws the figure from that file alone (cells
written before the pooled columns existed leave those columns out).

    python benchmarks/many_models.py --network mlp --out /work/results/many_models.jsonl
    python benchmarks/many_models.py --network vgg --out /work/results/many_models.jsonl
    python benchmarks/many_models.py --report --out /work/results/many_models.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from benchutil import append_jsonl, machine, read_jsonl
from flwr.app import ArrayRecord
from one_shot import NETWORKS, add_cell_arguments, run_config

from alignfl.core.model_io import build_run_model, load_arrays
from alignfl.core.training.sgd import evaluate
from alignfl.fl_app.analysis.merge import (
    matched_keys,
    merge_accuracies,
    repair_key,
    repair_merge,
    strategy_merge,
    train_clients,
)
from alignfl.fl_app.analysis.merge_options import OWN, POOLED, REPAIR_DATA, UNIVERSE
from alignfl.fl_app.client_app import client_data

BASES = {"average": "average", "matched-weight": "matched onto client 0", "matched-universe": "universe"}
SHORT = {"average": "average", "matched-weight": "matched", "matched-universe": "universe"}
MERGES = {
    key: name
    for base, long in BASES.items()
    for key, name in (
        (base, long),
        (repair_key(base, OWN), f"{SHORT[base]} + REPAIR"),
        (repair_key(base, POOLED), f"{SHORT[base]} + REPAIR pooled"),
    )
}
"""Accuracy key → column name of the merged models."""
REFERENCES = {"ensemble": "ensemble", "best-client": "best client"}
FIGURE = Path(__file__).parent / "figures" / "many_models.png"
CPU = torch.device("cpu")


def one_cell(network: str, clients: int, seed: int, epochs: int, alpha: float, train_size: int) -> dict[str, Any]:
    """Train ``clients`` models of ``network`` and score every merge of them (module notes)."""
    config = run_config(network, seed, epochs, alpha, train_size)
    started = time.perf_counter()
    states, counts, dataset, classes = train_clients(config, clients, same_init=False, device=CPU)
    trained = time.perf_counter()
    model = build_run_model(config, dataset)
    inputs = [client_data(config, k, clients).train_x for k in range(clients)]
    diagnostics: dict[str, Any] = {}
    singles, accuracy, _ = merge_accuracies(
        config,
        model,
        states,
        counts,
        dataset.test_x,
        dataset.test_y,
        ("weight",),
        1,
        CPU,
        classes,
        reference=UNIVERSE,
        diagnostics=diagnostics,
        repair_data=inputs,
        repair_on=REPAIR_DATA,
    )
    # Matching onto client 0 as merge_accuracies' reference=0 merges it, without scoring the rest a second time.
    merge = strategy_merge(config, model, "matched", matched_keys("weight", 1), states, counts, states[0])
    matched = merge.arrays.to_torch_state_dict()
    scored = {"matched-weight": matched}
    for on in REPAIR_DATA:
        scored[repair_key("matched-weight", on)] = repair_merge(
            model, matched, states, merge.unit_maps, inputs, counts, CPU, on
        )
    for key, state in scored.items():
        load_arrays(model, ArrayRecord(state))
        accuracy[key] = evaluate(model, dataset.test_x, dataset.test_y, CPU)[1]
    accuracy["best-client"] = max(singles)
    objective = diagnostics["universe-objective"]
    cycle = diagnostics["cycle-consistency-error"]
    return {
        "network": network,
        "clients": clients,
        "seed": seed,
        "epochs": epochs,
        "alpha": alpha,
        "train-size": train_size,
        "accuracy": accuracy,
        "client-accuracy": singles,
        "cycle-consistency-error": cycle,
        "cycle-consistency-error-mean": statistics.fmean(cycle.values()) if cycle else 0.0,
        "universe-iterations": len(objective) - 1,
        "universe-objective-start": objective[0],
        "universe-objective-relaxed": objective[-1],
        "universe-projected": diagnostics["universe-projected"],
        "train-s": trained - started,
        "merge-s": time.perf_counter() - trained,
        "machine": machine(),
    }


def _mean_std(values: list[float]) -> str:
    """``mean ± sd`` in percent (points)."""
    spread = f" ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else ""
    return f"{100 * statistics.fmean(values):.1f}{spread}"


def _pooled_against_own(network: str, by_k: dict[int, list[dict[str, Any]]], merges: dict[str, str]) -> list[str]:
    """Per K and merge, REPAIR pooled − REPAIR own in points: the mean over seeds and the range of the seeds'."""
    bases = [base for base in BASES if repair_key(base, POOLED) in merges]
    if not bases:
        return []
    out = [f"\n**{network}**: REPAIR pooled − REPAIR own in points, mean over seeds (min to max)\n"]
    out.append("| K | " + " | ".join(BASES[base] for base in bases) + " |")
    out.append("|---" * (len(bases) + 1) + "|")
    for k, group in by_k.items():
        texts = []
        for base in bases:
            gaps = [
                100 * (c["accuracy"][repair_key(base, POOLED)] - c["accuracy"][repair_key(base, OWN)]) for c in group
            ]
            texts.append(f"{statistics.fmean(gaps):+.1f} ({min(gaps):+.1f} to {max(gaps):+.1f})")
        out.append(f"| {k} | " + " | ".join(texts) + " |")
    return out


def report(cells: list[dict[str, Any]]) -> str:
    """Per network: accuracy of every merge, the barriers (ensemble − merge) and the matching's diagnostics."""
    out = []
    for network in sorted({c["network"] for c in cells}, key=list(NETWORKS).index):
        mine = [c for c in cells if c["network"] == network]
        ks = sorted({c["clients"] for c in mine})
        seeds = sorted({c["seed"] for c in mine})
        by_k = {k: [c for c in mine if c["clients"] == k] for k in ks}
        merges = {key: name for key, name in MERGES.items() if all(key in c["accuracy"] for c in mine)}
        columns = {**merges, **REFERENCES}
        out.append(f"**{network}**: test accuracy %, mean ± sd over seeds {seeds}\n")
        out.append("| K | " + " | ".join(columns.values()) + " |")
        out.append("|---" * (len(columns) + 1) + "|")
        for k in ks:
            texts = [_mean_std([c["accuracy"][key] for c in by_k[k]]) for key in columns]
            out.append(f"| {k} | " + " | ".join(texts) + " |")
        out.append(
            f"\n**{network}**: barrier, ensemble − merge in points (mean over seeds; best: the best merge per seed)\n"
        )
        out.append("| K | best merge | " + " | ".join(merges.values()) + " |")
        out.append("|---" * (len(merges) + 2) + "|")
        for k in ks:
            gaps = [statistics.fmean(c["accuracy"]["ensemble"] - c["accuracy"][key] for c in by_k[k]) for key in merges]
            best = statistics.fmean(
                c["accuracy"]["ensemble"] - max(c["accuracy"][key] for key in merges) for c in by_k[k]
            )
            out.append(f"| {k} | {100 * best:.1f} | " + " | ".join(f"{100 * g:.1f}" for g in gaps) + " |")
        out.extend(_pooled_against_own(network, by_k, merges))
        out.append(f"\n**{network}**: matching diagnostics (mean over seeds)\n")
        out.append(
            "| K | cycle-consistency error onto client 0 (mean over groups) | Frank-Wolfe iterations "
            "| objective gain, relaxed | objective gain, projected | train s | merge s |"
        )
        out.append("|---" * 7 + "|")
        for k in ks:
            group = by_k[k]

            def gain(key: str, cells: list[dict[str, Any]] = group) -> float:
                return statistics.fmean(
                    (c[key] - c["universe-objective-start"]) / abs(c["universe-objective-start"]) for c in cells
                )

            iterations = [c["universe-iterations"] for c in group]
            out.append(
                f"| {k} | {100 * statistics.fmean(c['cycle-consistency-error-mean'] for c in group):.1f} % "
                f"| {statistics.fmean(iterations):.1f} ({min(iterations)}–{max(iterations)}) "
                f"| {100 * gain('universe-objective-relaxed'):+.2f} % | {100 * gain('universe-projected'):+.2f} % "
                f"| {statistics.fmean(c['train-s'] for c in group):.0f} | {statistics.fmean(c['merge-s'] for c in group):.0f} |"
            )
        out.append("")
    return "\n".join(out)


def figure(cells: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against K, one line per method (mean over seeds, band: min–max), one panel per network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = sorted({c["network"] for c in cells}, key=list(NETWORKS).index)
    fig, axes = plt.subplots(1, len(networks), figsize=(4.6 * len(networks), 3.6), squeeze=False)
    styles = {key: ("C0" if "universe" in key else "C1" if "weight" in key else "0.5") for key in MERGES}
    for axis, network in zip(axes[0], networks):
        mine = [c for c in cells if c["network"] == network]
        ks = sorted({c["clients"] for c in mine})
        merges = {key: name for key, name in MERGES.items() if all(key in c["accuracy"] for c in mine)}
        for key, label in {**merges, **REFERENCES}.items():
            values = [[100 * c["accuracy"][key] for c in mine if c["clients"] == k] for k in ks]
            color = styles.get(key, "C2" if key == "ensemble" else "C3")
            line = (
                "-." if key.endswith(POOLED) else "--" if key.endswith("+repair") else ":" if key in REFERENCES else "-"
            )
            axis.plot(ks, [statistics.fmean(v) for v in values], line, marker="o", ms=3, color=color, label=label)
            axis.fill_between(ks, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.07, lw=0)
        axis.set_xscale("log", base=2)
        axis.set_xticks(ks, [str(k) for k in ks])
        axis.set_ylim(0, 100)
        axis.set_xlabel("clients merged K", fontsize=8)
        axis.set_ylabel("test accuracy %", fontsize=8)
        seeds = len({c["seed"] for c in mine})
        axis.set_title(f"{network}: K independent starts merged\n(mean of {seeds} seeds, band: min–max)", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per cell (appended)")
    parser.add_argument("--report", action="store_true", help="only print the tables and draw the figure")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {"epochs": args.epochs, "alpha": args.alpha, "train-size": args.train_size}
        done = {
            (c["network"], c["clients"], c["seed"])
            for c in read_jsonl(args.out)
            if all(c[key] == value for key, value in settings.items())
        }
        started = time.perf_counter()
        for clients in args.clients:
            for seed in args.seeds:
                if (args.network, clients, seed) in done:
                    continue
                cell = one_cell(args.network, clients, seed, args.epochs, args.alpha, args.train_size)
                append_jsonl(args.out, cell)
                print(
                    f"{args.network} K={clients} seed={seed}: "
                    + ", ".join(f"{key} {100 * value:.1f}" for key, value in cell["accuracy"].items())
                    + f" ({cell['train-s']:.0f} s + {cell['merge-s']:.0f} s)",
                    flush=True,
                )
        print(f"wall {time.perf_counter() - started:.0f} s, {machine()}")
    cells = read_jsonl(args.out)
    print(report(cells))
    if cells:
        figure(cells, args.figure)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
