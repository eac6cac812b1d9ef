"""Aggregate a Hydra sweep of ``alignfl.fl_app.sweeps.sweep``: one row per configuration, mean ± std over its seeds.

    python -m alignfl.fl_app.sweeps.report ~/alignfl-results/sweeps/<date_time> [--x pan.a --y pan.t --metric final-accuracy]

Writes ``summary.csv``, ``summary.md`` and ``heatmap.png`` into the sweep folder
(a multirun does the same at its end, through :class:`ReportSweep`). Jobs are
found by the ``.hydra/overrides.yaml`` Hydra writes as each job starts, so a job
that died without a word still counts: as failed, like one whose ``job.json``
says it failed or whose run has no ``summary.json``; a job a live process is
running (another sweep in the same folder: :mod:`alignfl.fl_app.sweeps.launches`) counts
as running. A configuration is a job's overrides without the seed.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from alignfl.fl_app.locations import program
from alignfl.fl_app.sweeps.launches import own_launch, running
from alignfl.fl_app.sweeps.slurm import read_jobs_record
from alignfl.fl_app.sweeps.sweep import COMPLETED, JOB_RECORD
from alignfl.fl_app.sweeps.tracking import finish_sweep_run, write_hparams

log = logging.getLogger(__name__)

SEED_KEY = "seed"  # conf/config.yaml excludes the same key from a configuration's folder name
TABLE_METRICS = ("final-accuracy", "best-accuracy")
CSV_NAME, MARKDOWN_NAME, HEATMAP_NAME = "summary.csv", "summary.md", "heatmap.png"


@dataclass(frozen=True)
class JobResult:
    """One job of the sweep as it ended."""

    folder: Path
    settings: tuple[tuple[str, str], ...]  # the job's overrides without the seed, in command-line order
    summary: dict[str, Any] | None  # the run's summary.json; None when the job failed
    wall_time_s: float | None
    error: str | None  # why it failed; who runs it, while it runs
    overrides: tuple[str, ...] = ()  # all of them, the seed's included
    running: bool = False  # a live process runs it now

    @property
    def failed(self) -> bool:
        return self.summary is None and not self.running


@dataclass(frozen=True)
class ConfigRow:
    """One configuration: its settings and its seeds' results."""

    settings: dict[str, str]
    jobs: tuple[JobResult, ...]

    @property
    def completed(self) -> list[JobResult]:
        return [job for job in self.jobs if job.summary is not None]

    @property
    def failed(self) -> int:
        return sum(job.failed for job in self.jobs)

    @property
    def running(self) -> int:
        return sum(job.running for job in self.jobs)

    def values(self, metric: str) -> list[float]:
        """``metric`` of every completed seed (summary.json keys, or ``job-time-s``)."""
        if metric == "job-time-s":
            return [job.wall_time_s for job in self.completed if job.wall_time_s is not None]
        return [float(job.summary[metric]) for job in self.completed if job.summary.get(metric) is not None]

    def stats(self, metric: str) -> tuple[float, float]:
        """Mean and sample standard deviation (NaN where undefined: no seed, or one)."""
        values = self.values(metric)
        mean = statistics.fmean(values) if values else math.nan
        std = statistics.stdev(values) if len(values) > 1 else math.nan
        return mean, std


@dataclass(frozen=True)
class Report:
    rows: list[ConfigRow]
    keys: list[str]  # every override key but the seed, in first-seen order
    varying: list[str]  # the keys whose value differs between configurations
    csv_path: Path
    markdown_path: Path
    heatmap_path: Path | None

    @property
    def jobs(self) -> int:
        return sum(len(row.jobs) for row in self.rows)

    @property
    def failed(self) -> int:
        return sum(row.failed for row in self.rows)

    @property
    def running(self) -> int:
        return sum(row.running for row in self.rows)


def _split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def read_job(folder: Path) -> JobResult:
    """A job's settings from Hydra's record, its outcome from job.json and its run's summary.json; a job a live
    process holds is running, whatever an earlier launch's job.json says."""
    overrides = tuple(_overrides(folder))
    settings = tuple((key, value) for key, value in map(_split_override, overrides) if key != SEED_KEY)
    holder = running(folder)
    if holder is not None:
        return JobResult(folder, settings, None, None, f"running: {holder}", overrides, running=True)
    record_path = folder / JOB_RECORD
    if not record_path.is_file():
        return JobResult(folder, settings, None, None, f"no {JOB_RECORD}: the job did not finish", overrides)
    record = json.loads(record_path.read_text())
    wall_time = record.get("job-wall-time-s")
    if record["status"] != COMPLETED:
        return JobResult(folder, settings, None, wall_time, record.get("error"), overrides)
    summary_path = Path(record["run-folder"]) / "summary.json"
    if not summary_path.is_file():
        return JobResult(folder, settings, None, wall_time, f"{summary_path} is missing", overrides)
    return JobResult(folder, settings, json.loads(summary_path.read_text()), wall_time, None, overrides)


def _sort_key(value: str) -> tuple[int, float | str]:
    """Numbers in numeric order, before words."""
    try:
        return 0, float(value)
    except ValueError:
        return 1, value


def _overrides(folder: Path) -> list[str]:
    return list(OmegaConf.to_container(OmegaConf.load(folder / ".hydra" / "overrides.yaml")))


def with_slurm_jobs(jobs: list[JobResult], sweep_dir: Path) -> list[JobResult]:
    """The jobs, where SLURM ran them (:data:`alignfl.fl_app.sweeps.slurm.JOBS_RECORD`): a failed job's error names its
    SLURM job id, end state and log, and a job SLURM ended before it made its folder is added as failed (one with a log
    was running, one without had not started)."""
    slurm = {tuple(job.overrides): job for job in read_jobs_record(sweep_dir)}
    if not slurm:
        return jobs
    found = []
    for job in jobs:
        record = slurm.pop(job.overrides, None)
        if record is not None and job.failed:
            job = replace(
                job, error=f"SLURM job {record.slurm_job_id} {record.state}, log {record.stderr}: {job.error}"
            )
        found.append(job)
    for record in slurm.values():
        settings = tuple(_split_override(o) for o in record.overrides)
        found.append(
            JobResult(
                Path(record.stderr).parent,
                tuple((k, v) for k, v in settings if k != SEED_KEY),
                None,
                None,
                f"SLURM job {record.slurm_job_id} {record.state} "
                + ("while it ran, before it made its folder" if Path(record.stdout).exists() else "before it started")
                + f", log {record.stderr}",
                tuple(record.overrides),
            )
        )
    return found


def collect(sweep_dir: Path) -> tuple[list[ConfigRow], list[str]]:
    """Group the sweep's jobs by configuration; returns the rows (sorted by their settings) and the keys."""
    jobs = [read_job(marker.parent.parent) for marker in sorted(sweep_dir.glob("**/.hydra/overrides.yaml"))]
    jobs = with_slurm_jobs(jobs, sweep_dir)
    keys = list(dict.fromkeys(key for job in jobs for key, _ in job.settings))
    groups: dict[tuple[str, ...], list[JobResult]] = {}
    for job in jobs:
        settings = dict(job.settings)
        groups.setdefault(tuple(settings.get(key, "") for key in keys), []).append(job)
    rows = [ConfigRow(dict(zip(keys, values)), tuple(group)) for values, group in groups.items()]
    rows.sort(key=lambda row: [_sort_key(row.settings[key]) for key in keys])
    return rows, keys


def _format(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def write_csv(rows: list[ConfigRow], keys: list[str], path: Path) -> None:
    columns = [*keys, "seeds", "failed", "running"]
    for metric in (*TABLE_METRICS, "job-time-s"):
        columns += [f"{metric}-mean", f"{metric}-std"]
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(columns)
        for row in rows:
            numbers = [value for metric in (*TABLE_METRICS, "job-time-s") for value in row.stats(metric)]
            writer.writerow(
                [
                    *(row.settings[k] for k in keys),
                    len(row.completed),
                    row.failed,
                    row.running,
                    *("" if math.isnan(v) else f"{v:.10g}" for v in numbers),
                ]
            )


def markdown_table(rows: list[ConfigRow], keys: list[str], varying: list[str]) -> str:
    """The table, with the settings every configuration shares in a line above it; a column of running jobs where
    another sweep in the folder still runs some."""
    shown = varying or keys
    fixed = [f"{key}={rows[0].settings[key]}" for key in keys if key not in shown] if rows else []
    counts = ["seeds", "failed", *(["running"] if any(row.running for row in rows) else [])]
    lines = [
        f"Settings shared by every row: `{' '.join(fixed)}`.\n" if fixed else "",
        "| " + " | ".join([*shown, *counts, "final accuracy", "best accuracy", "job time (s)"]) + " |",
        "|" + "---|" * (len(shown) + len(counts) + 3),
    ]
    for row in rows:
        cells = [row.settings[key] for key in shown] + [str(len(row.completed)), str(row.failed)]
        cells += [str(row.running)] if "running" in counts else []
        cells += [_format(*row.stats(metric), 4) for metric in TABLE_METRICS] + [_format(*row.stats("job-time-s"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    for title, jobs in (
        ("Failed jobs", [job for row in rows for job in row.jobs if job.failed]),
        ("Running jobs (another sweep in this folder)", [job for row in rows for job in row.jobs if job.running]),
    ):
        if jobs:
            lines += [f"\n{title}:", *(f"- `{job.folder}`: {job.error}" for job in jobs)]
    return "\n".join(line for line in lines if line) + "\n"


def heatmap_axes(varying: list[str], x: str, y: str) -> tuple[str, str] | None:
    """``(x, y)`` when the sweep varies both, else its first two varying keys; None when fewer vary."""
    if x in varying and y in varying and x != y:
        return x, y
    return (varying[0], varying[1]) if len(varying) >= 2 else None


def plot_heatmap(rows: list[ConfigRow], varying: list[str], x: str, y: str, metric: str, path: Path) -> None:
    """``metric`` (mean over seeds) over ``x`` × ``y``, one panel per combination of the other varying keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def levels(key: str) -> list[str]:
        return sorted({row.settings[key] for row in rows}, key=_sort_key)

    xs, ys = levels(x), levels(y)
    others = [key for key in varying if key not in (x, y)]
    panels = list(product(*(levels(key) for key in others)))
    means = {tuple(row.settings[k] for k in (*others, x, y)): row.stats(metric) for row in rows}
    finite = [mean for mean, _ in means.values() if not math.isnan(mean)]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)

    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(1.2 + 1.3 * len(xs) * len(panels), 1.4 + 0.75 * len(ys)),
        squeeze=False,
        constrained_layout=True,
    )
    for ax, panel in zip(axes[0], panels):
        grid = [[means.get((*panel, xv, yv), (math.nan, math.nan)) for xv in xs] for yv in ys]
        image = ax.imshow(
            [[mean for mean, _ in line] for line in grid],
            cmap="viridis",
            vmin=vmin,
            vmax=vmax,
            origin="lower",
            aspect="auto",
        )
        for i, line in enumerate(grid):
            for j, (mean, std) in enumerate(line):
                text = "n/a" if math.isnan(mean) else f"{mean:.3f}" + ("" if math.isnan(std) else f"\n±{std:.3f}")
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if not math.isnan(mean) and mean > (vmin + vmax) / 2 else "white",
                )
        ax.set_xticks(range(len(xs)), xs)
        ax.set_yticks(range(len(ys)), ys)
        ax.set(xlabel=x, ylabel=y, title=", ".join(f"{k}={v}" for k, v in zip(others, panel)) or None)
    fig.colorbar(image, ax=axes[0].tolist(), label=f"{metric} (mean over seeds)")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(sweep_dir: Path, x: str = "pan.a", y: str = "pan.t", metric: str = "final-accuracy") -> Report:
    """Write the CSV, the Markdown table and (when two keys vary) the heatmap into ``sweep_dir``."""
    sweep_dir = sweep_dir.resolve()
    rows, keys = collect(sweep_dir)
    if not rows:
        raise FileNotFoundError(f"no Hydra jobs (.hydra/overrides.yaml) under {sweep_dir}")
    summaries = [job.summary for row in rows for job in row.completed]
    if summaries and not any(metric in summary for summary in summaries):
        raise ValueError(f"heatmap metric {metric!r} is in no run's summary.json; choose one of {sorted(summaries[0])}")
    varying = [key for key in keys if len({row.settings[key] for row in rows}) > 1]
    csv_path, markdown_path = sweep_dir / CSV_NAME, sweep_dir / MARKDOWN_NAME
    write_csv(rows, keys, csv_path)
    markdown_path.write_text(markdown_table(rows, keys, varying))
    axes = heatmap_axes(varying, x, y)
    heatmap_path = sweep_dir / HEATMAP_NAME if axes else None
    if axes:
        plot_heatmap(rows, varying, *axes, metric, heatmap_path)
    else:
        log.info("no heatmap: fewer than two swept keys vary (%s)", varying)
    swept = varying or keys
    write_hparams(
        sweep_dir,
        [
            (Path(job.summary["run-folder"]), {key: row.settings[key] for key in swept}, job.summary)
            for row in rows
            for job in row.completed
            if "run-folder" in job.summary
        ],
    )
    report = Report(rows, keys, varying, csv_path, markdown_path, heatmap_path)
    for row in rows:
        for job in row.jobs:
            if job.failed:
                log.error("failed job %s: %s", job.folder, job.error)
    return report


def launch_outcome(report: Report, sweep_dir: Path) -> tuple[int, int]:
    """How many jobs the launch this process started in ``sweep_dir`` has, and how many of them failed (one that
    never made its folder counts as failed); every job of the report where this process recorded no launch."""
    jobs = [job for row in report.rows for job in row.jobs]
    launch = own_launch(sweep_dir)
    if launch is None:
        return len(jobs), sum(job.failed for job in jobs)
    own = {tuple(overrides) for overrides in launch[1]["jobs"]}
    found = [job for job in jobs if job.overrides in own]
    return len(own), sum(job.failed for job in found) + len(own - {job.overrides for job in found})


class ReportSweep(Callback):
    """At the end of a multirun, write the folder's report; exit non-zero when a job of this sweep failed (not for
    a job of another sweep in the same folder, which that sweep reports)."""

    def __init__(self, heatmap_x: str = "pan.a", heatmap_y: str = "pan.t", metric: str = "final-accuracy") -> None:
        self.heatmap_x, self.heatmap_y, self.metric = heatmap_x, heatmap_y, metric

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        report = write_report(Path(config.hydra.sweep.dir), self.heatmap_x, self.heatmap_y, self.metric)
        files = [report.markdown_path, report.csv_path, *([report.heatmap_path] if report.heatmap_path else [])]
        finish_sweep_run(
            report.markdown_path.parent,
            {
                key: sorted({row.settings[key] for row in report.rows}, key=_sort_key)
                for key in report.varying or report.keys
            },
            report.jobs,
            report.failed,
            files,
        )
        jobs, failed = launch_outcome(report, Path(config.hydra.sweep.dir).resolve())
        others = report.jobs - jobs
        print(
            f"[alignfl] sweep done: {jobs - failed} of {jobs} jobs completed"
            + (f" (the folder holds {others} more, {report.running} running)" if others > 0 else "")
            + f"; summary: {report.markdown_path} (also {', '.join(str(path) for path in files[1:])})",
            flush=True,
        )
        if failed:
            # Hydra turns a callback's exception into a warning; exiting gives the sweep a non-zero status.
            raise SystemExit(f"{failed} of {jobs} sweep jobs failed; see {report.markdown_path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("alignfl.fl_app.sweeps.report"), description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="the multirun's folder (hydra.sweep.dir)")
    parser.add_argument("--x", default="pan.a", help="heatmap columns: a swept key (default: pan.a)")
    parser.add_argument("--y", default="pan.t", help="heatmap rows: a swept key (default: pan.t)")
    parser.add_argument(
        "--metric",
        default="final-accuracy",
        help="heatmap value: a summary.json key, e.g. best-accuracy (default: final-accuracy)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        report = write_report(args.sweep_dir, args.x, args.y, args.metric)
    except (FileNotFoundError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print(report.markdown_path.read_text())
    print(
        f"{report.jobs} jobs, {report.failed} failed, {report.running} running; wrote {report.csv_path}, {report.markdown_path}"
        + (f", {report.heatmap_path}" if report.heatmap_path else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
