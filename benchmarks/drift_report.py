"""The drift study's tables and heatmap from its sweep folder (``python -m alignfl.fl_app.sweep +experiment=drift``).

For each network and method: final test accuracy (mean ± sd over seeds) per local-epoch count E and Dirichlet
alpha with its gain over FedAvg on the same network in the same cell and the same seeds (Ψ-Net's against FedAvg
on plain VGG-9, as Fed2 compares), and the units moved there: from the rounds' start (each client matched onto the
model its round started from), between the clients (every client matched onto the lowest partition's client;
round 1's share apart) and by the method's own matching (``units-moved``; OT fusion's ``transport-off-diagonal``,
the mass its maps move off the diagonal), from the jobs' per-round metrics.
Jobs swept over ``train.repair=off,on`` appear as two methods, ``<method>`` and ``<method>+repair``; jobs that
scored the global model every round (``train.server_evaluate_every=1``) also get a table of accuracy per round.

    python benchmarks/drift_report.py <sweep folder>        # writes drift.md and drift_heatmap.png there
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from alignfl.core.merging.drift import MOVED_BETWEEN, MOVED_FROM_START
from alignfl.fl_app.sweeps.report import SEED_KEY, ConfigRow, collect

RUN, EPOCHS, ALPHA, REPAIR = "experiment/drift_run", "experiment/drift_epochs", "data.dirichlet_alpha", "train.repair"
METRIC, MATCHED, TRANSPORTED = "final-accuracy", "units-moved", "transport-off-diagonal"
AXES = (RUN, EPOCHS, ALPHA)
"""The overrides that make a job the drift study's: its run, its local epochs (``e<E>``) and its Dirichlet alpha."""


def is_study_row(row: ConfigRow) -> bool:
    """Whether a configuration is the drift study's: it sets every key of :data:`AXES` (a run of
    ``experiment/drift_run``, epochs ``e<E>``); a plain sweep's rows in the same folder are not."""
    network, _, method = row.settings.get(RUN, "").partition("-")
    epochs = row.settings.get(EPOCHS, "").removeprefix("e")
    return bool(network and method and epochs.isdigit() and row.settings.get(ALPHA))


def _cells(rows: list[ConfigRow]) -> dict[tuple[str, str, int, str], ConfigRow]:
    """(network, method, E, alpha) → the configuration's row (the drift study's rows only); a job run with
    ``train.repair=on`` is its own method, ``<method>+repair``."""
    cells = {}
    for row in filter(is_study_row, rows):
        network, _, method = row.settings[RUN].partition("-")
        method += "+repair" if row.settings.get(REPAIR) == "on" else ""
        cells[(network, method, int(row.settings[EPOCHS].removeprefix("e")), row.settings[ALPHA])] = row
    return cells


def _by_seed(row: ConfigRow | None) -> dict[str, float]:
    """Seed → final accuracy of the configuration's completed jobs."""
    if row is None:
        return {}
    return {
        next((o for o in job.overrides if o.startswith(f"{SEED_KEY}=")), ""): float(job.summary[METRIC])
        for job in row.completed
        if job.summary.get(METRIC) is not None
    }


def paired_gain(row: ConfigRow | None, baseline: ConfigRow | None) -> tuple[float, float, int]:
    """The gain over ``baseline`` in points on the seeds both completed (one seed's spread between runs is often
    larger than a method's effect, so a gain is only read seed against seed): mean, sample sd (NaN for one
    seed) and how many seeds; NaN and 0 where they share none."""
    own, base = _by_seed(row), _by_seed(baseline)
    gains = [100 * (own[seed] - base[seed]) for seed in sorted(own.keys() & base.keys())]
    if not gains:
        return math.nan, math.nan, 0
    return statistics.fmean(gains), statistics.stdev(gains) if len(gains) > 1 else math.nan, len(gains)


def _cell_text(row: ConfigRow | None, baseline: ConfigRow | None) -> str:
    """Final accuracy ± sd over seeds and the gain over FedAvg in points on the same seeds (± its sd; how many
    where one of the two ran seeds the other did not)."""
    if row is None or not row.completed:
        return "–"
    mean, std = row.stats(METRIC)
    spread = f" ± {100 * std:.1f}" if not math.isnan(std) else ""
    gain, gain_std, seeds = paired_gain(row, baseline)
    if not seeds:
        return f"{100 * mean:.1f}{spread}"
    gain_spread = f" ± {gain_std:.1f}" if not math.isnan(gain_std) else ""
    fewer = (
        f" on {seeds} seed{'s' if seeds > 1 else ''}"
        if seeds < max(map(len, (_by_seed(row), _by_seed(baseline))))
        else ""
    )
    return f"{100 * mean:.1f}{spread} ({gain:+.1f}{gain_spread}{fewer})"


def _share(value: object) -> float | None:
    """A metrics row's units-moved entry (a share per group, or one share) as one share: the mean over groups."""
    if isinstance(value, dict):
        return statistics.fmean(value.values()) if value else None
    return float(value) if isinstance(value, int | float) else None


def _moved_text(row: ConfigRow | None) -> str:
    """Units moved in percent, mean over seeds, rounds and groups: from the round's start, between the clients
    (round 1's share in brackets: the clients' first drift from one model) and by the method's own matching or, for
    OT fusion, its transport (the mass off the diagonal; round 1's in brackets)."""
    if row is None or not row.completed:
        return "–"
    labels = (("start", MOVED_FROM_START), ("between", MOVED_BETWEEN), ("matching", MATCHED), ("OT", TRANSPORTED))
    per_round = {key: _per_round(row, key, _share) for _, key in labels}
    texts = []
    for label, key in labels:
        if shares := per_round[key]:
            first = f" [{100 * shares[min(shares)]:.1f}]" if key in (MOVED_BETWEEN, TRANSPORTED) else ""
            texts.append(f"{label} {100 * statistics.fmean(shares.values()):.1f}{first}")
    return ", ".join(texts) or "not logged"


def tables(cells: dict[tuple[str, str, int, str], ConfigRow]) -> str:
    """Two markdown tables per network, methods × (E, alpha): final accuracy with the gain over FedAvg, and the
    units moved."""
    epochs = sorted({key[2] for key in cells})
    alphas = sorted({key[3] for key in cells}, key=float)
    columns = [(e, a) for a in alphas for e in epochs]
    out = []
    for network in sorted({key[0] for key in cells}):
        methods = sorted({key[1] for key in cells if key[0] == network}, key=lambda m: (m != "fedavg", m))
        header = [
            "| method | " + " | ".join(f"E={e}, α={a}" for e, a in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        out += [
            f"**{network}** — final accuracy % ± sd over seeds (gain over FedAvg in points on the same seeds "
            "± its sd over them)\n",
            *header,
        ]
        for method in methods:
            baselines = (cells.get((network, "fedavg", e, a)) for e, a in columns)
            texts = [
                _cell_text(cells.get((network, method, e, a)), b) for (e, a), b in zip(columns, baselines, strict=True)
            ]
            out.append(f"| {method} | " + " | ".join(texts) + " |")
        out += [
            "",
            f"**{network}** — units moved, % (mean over seeds, rounds and groups): each client matched onto its "
            "round's start, every client matched onto the lowest partition's client [round 1 in brackets], and by "
            "the method's own matching (OT: the mass its transport moves off the diagonal [round 1])\n",
            *header,
        ]
        for method in methods:
            out.append(
                f"| {method} | "
                + " | ".join(_moved_text(cells.get((network, method, e, a))) for e, a in columns)
                + " |"
            )
        out.append("")
    return "\n".join(out)


def _per_round(
    row: ConfigRow, key: str, value: Callable[[object], float | None] = lambda v: None if v is None else float(v)
) -> dict[int, float]:
    """Round → ``key`` of the metrics rows (read by ``value``), mean over the configuration's completed seeds
    (rounds that have it)."""
    values: dict[int, list[float]] = {}
    for job in row.completed:
        for line in (Path(job.summary["run-folder"]) / "metrics.jsonl").read_text().splitlines():
            metrics = json.loads(line)
            if (read := value(metrics.get(key))) is not None:
                values.setdefault(metrics["round"], []).append(read)
    return {r: statistics.fmean(v) for r, v in sorted(values.items())}


def rounds_table(cells: dict[tuple[str, str, int, str], ConfigRow]) -> str:
    """Where the jobs scored the global model every round (``train.server_evaluate_every=1``): its test accuracy
    after each round, and with REPAIR the mean change it made to a unit's std (``repair-std-change``); empty
    otherwise."""
    per_round = {key: _per_round(row, "accuracy") for key, row in cells.items() if row.completed}
    if all(len(accuracies) <= 2 for accuracies in per_round.values()):
        return ""  # round 0 and the last only
    rounds = sorted({r for accuracies in per_round.values() for r in accuracies})
    out = ["\nGlobal model's test accuracy % after each round, mean over seeds (with REPAIR: mean std change)\n"]
    out.append("| network, method, E, α | " + " | ".join(f"round {r}" for r in rounds) + " |")
    out.append("|---" * (len(rounds) + 1) + "|")
    for key in sorted(per_round):
        changes = _per_round(cells[key], "repair-std-change")
        texts = [
            f"{100 * per_round[key][r]:.1f}" + (f" ({changes[r]:.3g})" if r in changes else "")
            if r in per_round[key]
            else "–"
            for r in rounds
        ]
        out.append(f"| {key[0]}, {key[1]}, E={key[2]}, α={key[3]} | " + " | ".join(texts) + " |")
    return "\n".join(out) + "\n"


def heatmap(cells: dict[tuple[str, str, int, str], ConfigRow], path: Path) -> Path | None:
    """Gain over FedAvg (points) against E and alpha: one panel per network and method; None (nothing drawn)
    where FedAvg is the only method."""
    panels = sorted({(key[0], key[1]) for key in cells if key[1] != "fedavg"})
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted({key[2] for key in cells})
    alphas = sorted({key[3] for key in cells}, key=float)
    networks = sorted({n for n, _ in panels})
    width = max(sum(1 for n, _ in panels if n == network) for network in networks)
    fig, axes = plt.subplots(len(networks), width, figsize=(2.4 * width, 2.8 * len(networks)), squeeze=False)
    fig.subplots_adjust(hspace=0.6)  # a row's axis labels clear of the next row's titles
    for axis in axes.flat:
        axis.set_visible(False)
    for r, network in enumerate(networks):
        for c, (_, method) in enumerate(p for p in panels if p[0] == network):
            gains = [
                [
                    paired_gain(cells.get((network, method, e, a)), cells.get((network, "fedavg", e, a)))[0]
                    for e in epochs
                ]
                for a in alphas
            ]
            axis = axes[r][c]
            axis.set_visible(True)
            image = axis.imshow(gains, cmap="RdBu", vmin=-10, vmax=10, aspect="auto")
            for i, line in enumerate(gains):
                for j, gain in enumerate(line):
                    axis.text(j, i, "–" if math.isnan(gain) else f"{gain:+.1f}", ha="center", va="center", fontsize=7)
            axis.set_xticks(range(len(epochs)), [str(e) for e in epochs], fontsize=7)
            axis.set_yticks(range(len(alphas)), alphas if c == 0 else [], fontsize=7)
            axis.set_title(f"{network}: {method}", fontsize=8)
            axis.set_xlabel("local epochs E", fontsize=7)
            if c == 0:
                axis.set_ylabel("Dirichlet α", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="gain over FedAvg (points)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the drift study's sweep folder")
    args = parser.parse_args(argv)
    rows, _ = collect(args.sweep)
    cells = _cells(rows)
    if not cells:
        parser.error(
            f"{args.sweep} holds no drift-study job (one whose overrides set {', '.join(AXES)}, as "
            "`python -m alignfl.fl_app.sweep +experiment=drift` does); for another sweep's folder use "
            "`python -m alignfl.fl_app.sweeps.report`"
        )
    study = [row for row in rows if is_study_row(row)]
    text = tables(cells) + rounds_table(cells)
    failed, running = sum(row.failed for row in study), sum(row.running for row in study)
    text += f"\n{sum(len(row.jobs) for row in study)} jobs, {failed} failed, {running} running.\n"
    others = sum(len(row.jobs) for row in rows) - sum(len(row.jobs) for row in study)
    text += f"{others} other jobs in the folder are not the drift study's: left out.\n" if others else ""
    (args.sweep / "drift.md").write_text(text)
    drawn = heatmap(cells, args.sweep / "drift_heatmap.png")
    print(text)
    print(
        f"wrote {args.sweep / 'drift.md'}" + (f" and {drawn}" if drawn else " (no heatmap: FedAvg is the only method)")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
