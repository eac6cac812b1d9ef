"""Experiment presets (conf/experiment/): smoke-run the -cpu presets, run one with its wall time and load recorded,
and table a preset's sweep with the figures its paper reports.

    python benchmarks/presets.py smoke [--out DIR] [NAME ...]      # every -cpu preset: each configuration, seed 0, 1 round
    python benchmarks/presets.py run NAME [--out DIR] [OVERRIDE ...]   # the whole preset (3 seeds), timed
    python benchmarks/presets.py table SWEEP_DIR [--metrics KEY ...]   # mean ± std over seeds, per configuration

Every sweep runs as ``nice python -m alignfl.fl_app.sweep +experiment=NAME sim.ray_cpus=2 sim.torch_threads=1`` (this
machine has 2 shared cores), in ``OUT/NAME`` (default ``~/alignfl-results/sweeps/presets``). ``run`` and ``smoke``
sample ``/proc/loadavg`` every 10 s while the sweep runs and write ``timing.json`` beside ``summary.md``: wall time,
the 1-minute load average at the start, its mean and maximum over the run (the load includes the sweep itself:
about 2 when it runs alone on the 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignfl.fl_app.sweeps.report import collect  # noqa: E402

DEFAULT_OUT = Path.home() / "alignfl-results" / "sweeps" / "presets"
MACHINE = ("sim.ray_cpus=2", "sim.torch_threads=1")
SMOKE = ("seed=0", "train.num_server_rounds=1")
#: summary.json keys shown when a sweep has them, in this order (accuracies are shown in %).
METRICS = (
    "final-accuracy",
    "last-5-mean-accuracy",
    "best-accuracy",
    "final-local-accuracy-mean",
    "final-personal-accuracy-mean",
    "final-honest-accuracy-mean",
    "final-oracle-accuracy-mean",
    "final-superfed-local-trained-mean",
    "final-personal-trained-mean",
)


def presets(cpu_only: bool = False) -> list[str]:
    names = sorted(path.stem for path in (ROOT / "conf" / "experiment").glob("*.yaml"))
    return [name for name in names if name.endswith("-cpu")] if cpu_only else names


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_sweep(name: str, folder: Path, overrides: list[str]) -> dict[str, Any]:
    """``python -m alignfl.fl_app.sweep +experiment=name`` under nice, in ``folder``; returns the timing record."""
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} is not empty: give each sweep its own folder (--out)")
    command = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "alignfl.fl_app.sweep",
        f"+experiment={name}",
        *MACHINE,
        *overrides,
        f"hydra.sweep.dir={folder}",
    ]
    samples: list[float] = [loadavg()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(10):
            samples.append(loadavg())

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.time()
    sampler.start()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    log = folder.parent / f"{folder.name}.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT).returncode
    done.set()
    sampler.join()
    record = {
        "preset": name,
        "command": " ".join(command[3:]),
        "exit-status": status,
        "wall-time-s": round(time.time() - started, 1),
        "load-start": samples[0],
        "load-mean": round(statistics.fmean(samples), 2),
        "load-max": max(samples),
        "log": str(log),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "timing.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _format(values: list[float], percent: bool) -> str:
    if not values:
        return "–"
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {statistics.stdev(values) * scale:.2f}"


def round_times(run_folder: Path) -> list[float]:
    """Seconds per round after the first (Ray's start and the first partitioning are in round 1)."""
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    elapsed = [row["elapsed-s"] for row in rows]
    return [b - a for a, b in zip(elapsed[1:], elapsed[2:])]


def table(sweep_dir: Path, metrics: list[str] | None = None) -> str:
    """Markdown: one row per configuration, mean ± sample std over its seeds of each metric, job wall time and
    the median time per round (rounds 2+) over its seeds' runs."""
    rows, keys = collect(sweep_dir)
    varying = [key for key in keys if len({row.settings[key] for row in rows}) > 1] or keys
    summaries = [job.summary for row in rows for job in row.completed]
    shown = [m for m in (metrics or METRICS) if any(s.get(m) is not None for s in summaries)]
    header = [*varying, "seeds", "failed", *shown, "job wall (s)", "s / round (rounds 2+, median)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.settings[key] for key in varying] + [str(len(row.completed)), str(row.failed)]
        for metric in shown:
            values = [v for v in row.values(metric) if not math.isnan(v)]
            cells.append(_format(values, percent="accuracy" in metric))
        cells.append(_format(row.values("job-time-s"), percent=False).split(".")[0] if row.completed else "–")
        per_round = [t for job in row.completed for t in round_times(Path(job.summary["run-folder"]))]
        cells.append(f"{statistics.median(per_round):.1f}" if per_round else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/presets.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    smoke = commands.add_parser("smoke", help="each -cpu preset: every configuration, seed 0, one round")
    smoke.add_argument("names", nargs="*", help="presets (default: every -cpu preset)")
    smoke.add_argument("--out", type=Path, default=DEFAULT_OUT / f"smoke-{time.strftime('%Y%m%d-%H%M%S')}")
    run = commands.add_parser("run", help="one preset, all its jobs, timed")
    run.add_argument("name")
    run.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    report = commands.add_parser("table", help="a finished preset sweep as a Markdown table")
    report.add_argument("sweep_dir", type=Path)
    report.add_argument("--metrics", nargs="+", help=f"summary.json keys (default: those of {list(METRICS)} it has)")
    args, extra = parser.parse_known_args(argv)  # Hydra overrides may come after --out
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "table":
        print(table(args.sweep_dir, args.metrics), end="")
        return 0
    if args.command == "run":
        record = run_sweep(args.name, args.out / args.name, [*args.overrides, *extra])
        print(json.dumps(record, indent=2))
        if (args.out / args.name / "summary.md").is_file():
            print(table(args.out / args.name), end="")
        return record["exit-status"]
    failures = 0
    for name in args.names or presets(cpu_only=True):
        record = run_sweep(name, args.out / name, list(SMOKE))
        rows, _ = collect(args.out / name) if (args.out / name).is_dir() else ([], [])
        jobs = sum(len(row.jobs) for row in rows)
        failed = sum(row.failed for row in rows)
        failures += record["exit-status"] != 0 or failed > 0 or jobs == 0
        print(
            f"{name}: exit {record['exit-status']}, {jobs} jobs, {failed} failed, {record['wall-time-s']} s, "
            f"load {record['load-start']} at the start, mean {record['load-mean']}, max {record['load-max']}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
