"""A Hydra multirun's fixed cost per job: the same 12-job grid with Ray's simulation engine and in-process.

Each backend runs ``python -m alignfl.fl_app.sweep -m`` over pan.a × seed (3 × 4 jobs, digits, small-mlp, 4
clients, 2 rounds) into its own folder; the table gives the grid's wall time, the median, min and max job
wall time (``job.json``), the load before and after, and whether every job's final accuracy is the same
under both backends.

    .venv/bin/python benchmarks/sweep_fixed_cost.py --out /tmp/sweep-fixed-cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = [
    "dataset=digits",
    "model=small-mlp",
    "train.num_server_rounds=2",
    "sim.num_supernodes=4",
    "sim.ray_cpus=2",
    "sim.torch_threads=1",
    "pan.mode=mul",
    "pan.a=0,0.05,0.1",
    "seed=0,1,2,3",
]


def run_grid(backend: str, folder: Path) -> dict:
    load_before, started = os.getloadavg()[0], time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "alignfl.fl_app.sweep",
            "-m",
            *GRID,
            f"sim.backend={backend}",
            f"hydra.sweep.dir={folder}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    records = {
        path.parent.relative_to(folder).as_posix().replace(f"sim.backend={backend},", ""): json.loads(path.read_text())
        for path in folder.glob("*/seed=*/job.json")
    }
    finals = {
        job: json.loads((Path(r["run-folder"]) / "summary.json").read_text())["final-accuracy"]
        for job, r in records.items()
    }
    walls = [r["job-wall-time-s"] for r in records.values()]
    return {
        "grid-s": time.time() - started,
        "jobs": len(records),
        "median": statistics.median(walls),
        "min": min(walls),
        "max": max(walls),
        "load": (load_before, os.getloadavg()[0]),
        "finals": finals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the two sweeps")
    args = parser.parse_args()
    results = {backend: run_grid(backend, args.out / backend) for backend in ("ray", "inprocess")}
    print(
        "| backend | jobs | grid wall s | job wall s: median (min–max) | load before → after |\n|---|---|---|---|---|"
    )
    for backend, r in results.items():
        print(
            f"| {backend} | {r['jobs']} | {r['grid-s']:.1f} | {r['median']:.1f} ({r['min']:.1f}–{r['max']:.1f}) | "
            f"{r['load'][0]:.1f} → {r['load'][1]:.1f} |"
        )
    same = results["ray"]["finals"] == results["inprocess"]["finals"]
    print(f"\nsame final accuracy in every job under both backends: {same}")


if __name__ == "__main__":
    main()
