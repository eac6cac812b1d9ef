"""FedMA's published protocol from its sweep folder (``python -m alignfl.fl_app.sweep +experiment=fedma-protocol-cpu``):
the global model's test accuracy against communication rounds (the FedMA paper's own axis), mean ± sd over seeds.

Every method's round 1 trains the clients from their own initialisations; FedAvg's and FedProx's round 2 starts
from the average of those models. One communication round is one server round, except for FedMA, whose round is
one cycle of ``study.stages`` server rounds (one per permutation group, then the output layer): its accuracy is read
at the end of each cycle. The table also gives the share of units moved between the clients (every client matched
onto the first one) in round 1 and over the later rounds, from the round's start over the later rounds, and by the
method's own matching (OT fusion: the mass its maps move off the diagonal) in round 1 and later.

    python benchmarks/protocol_report.py <sweep folder>     # writes protocol.md and protocol.png there
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from alignfl.fl_app.sweeps.report import ConfigRow, collect

METHOD = "experiment/protocol_method"
FROM_START, BETWEEN = "client-units-moved", "client-units-moved-between"
OWN_MOVES = ("units-moved", "transport-off-diagonal")
"""The method's own moves: its matching's share of units moved, or the mass OT fusion's maps move off the diagonal."""


def _rows(job_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (job_folder / "metrics.jsonl").read_text().splitlines()]


def curve(row: ConfigRow, stages: int) -> dict[int, list[float]]:
    """Communication round → the seeds' global test accuracy after it (round 0: the initial global model)."""
    points: dict[int, list[float]] = {}
    for job in row.completed:
        for metrics in _rows(Path(job.summary["run-folder"])):
            server_round = metrics["round"]
            if metrics.get("accuracy") is not None and server_round % stages == 0:
                points.setdefault(server_round // stages, []).append(float(metrics["accuracy"]))
    return dict(sorted(points.items()))


def _moved(row: ConfigRow, keys: Sequence[str], first_round: bool) -> float:
    """Mean over seeds, groups and (later) rounds of the first of ``keys`` a metrics row has (a share per group);
    NaN where no round has one."""
    shares = []
    for job in row.completed:
        for metrics in _rows(Path(job.summary["run-folder"])):
            moved = next((metrics[key] for key in keys if isinstance(metrics.get(key), dict) and metrics[key]), None)
            if moved and (metrics["round"] == 1) == first_round:
                shares.append(sum(moved.values()) / len(moved))
    return statistics.fmean(shares) if shares else math.nan


def _spread(values: list[float]) -> str:
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{mean:.1f}"


def _percent(share: float) -> str:
    return "–" if math.isnan(share) else f"{100 * share:.1f}"


def table(methods: dict[str, ConfigRow], curves: dict[str, dict[int, list[float]]]) -> str:
    rounds = sorted({r for points in curves.values() for r in points})
    out = [
        "Global test accuracy % after each communication round, mean ± sd over seeds; units moved % (between the "
        "clients in round 1 | between them later | from the round's start later | by the method's own matching or "
        "transport, round 1 | later)\n",
        "| method | seeds | " + " | ".join(f"round {r}" for r in rounds) + " | moved between, round 1 | "
        "moved between, later | moved from start, later | moved by the method, round 1 | later | job s |",
        "|---" * (len(rounds) + 8) + "|",
    ]
    for method, row in methods.items():
        points = curves[method]
        cells = [_spread(points[r]) if r in points else "–" for r in rounds]
        moved = [
            _moved(row, (BETWEEN,), True),
            _moved(row, (BETWEEN,), False),
            _moved(row, (FROM_START,), False),
            _moved(row, OWN_MOVES, True),
            _moved(row, OWN_MOVES, False),
        ]
        times = row.values("job-time-s")
        seconds = f"{statistics.median(times):.0f}" if times else "–"
        texts = [*cells, *(_percent(share) for share in moved), seconds]
        out.append(f"| {method} | {len(row.completed)} | " + " | ".join(texts) + " |")
    return "\n".join(out) + "\n"


def figure(curves: dict[str, dict[int, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, points in curves.items():
        rounds = list(points)
        means = [100 * statistics.fmean(points[r]) for r in rounds]
        spreads = [100 * statistics.stdev(points[r]) if len(points[r]) > 1 else 0.0 for r in rounds]
        ax.errorbar(rounds, means, yerr=spreads, marker="o", markersize=3, capsize=2, label=method)
    ax.set(xlabel="communication round (FedMA: one cycle)", ylabel="global test accuracy %")
    ax.set_title("FedMA's protocol: independent starts, then federated rounds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the protocol preset's sweep folder")
    parser.add_argument(
        "--stages", type=int, default=5, help="server rounds of one FedMA cycle (study.stages: MLP 5, VGG-9 9)"
    )
    args = parser.parse_args(argv)
    rows, _ = collect(args.sweep)
    methods = {row.settings[METHOD]: row for row in rows if METHOD in row.settings and row.completed}
    if not methods:
        parser.error(
            f"{args.sweep} holds no finished job of the protocol preset (one whose overrides set {METHOD}, as "
            "`python -m alignfl.fl_app.sweep +experiment=fedma-protocol-cpu` does)"
        )
    curves = {method: curve(row, args.stages if method == "fedma" else 1) for method, row in methods.items()}
    text = table(methods, curves)
    (args.sweep / "protocol.md").write_text(text)
    figure(curves, args.sweep / "protocol.png")
    print(text)
    print(f"wrote {args.sweep / 'protocol.md'} and {args.sweep / 'protocol.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
