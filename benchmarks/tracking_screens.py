"""Look at a sweep in TensorBoard and MLflow, in a real browser: screenshots of TensorBoard's scalars and HParams
views and of MLflow's run comparison (not in CI: needs Debian's ``chromium``).

Runs a small PAN sweep in-process (``digits``, 2 × 2 grid of T and A, ``tracking=both``, MLflow in a SQLite file
of the output folder), starts ``tensorboard`` and ``mlflow ui`` on 127.0.0.1 (free ports, each in its own process
group, stopped by pid whatever happens), and has headless Chromium take one screenshot of each view.

    apt-get install -y chromium
    .venv/bin/python benchmarks/tracking_screens.py --out /tmp/tracking-screens [--figures benchmarks/figures]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = [
    "dataset=digits",
    "model=small-mlp",
    "sim.backend=inprocess",
    "sim.num_supernodes=4",
    "train.num_server_rounds=6",
    "tracking=both",
    "pan.mode=mul",
    "pan.t=1,4",
    "pan.a=0,0.5",
]
SHOTS = ("tensorboard-scalars", "tensorboard-hparams", "mlflow-compare")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(command: list[str], url: str, log: Path) -> Iterator[None]:
    """Run a web UI until the block ends; it answers ``url`` first. Stopped by its process group id."""
    with log.open("w") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{command[0]} did not answer {url}; see {log}") from None
                time.sleep(1)
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def screenshot(url: str, path: Path, size: str = "1400,900") -> None:
    """One headless Chromium screenshot; the virtual-time budget lets the single-page apps load their data."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium is not installed: apt-get install -y chromium")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={size}",
            "--virtual-time-budget=15000",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    print(f"[screens] {path} ({path.stat().st_size} bytes)", flush=True)


def run_sweep(sweep_dir: Path, uri: str) -> None:
    if (sweep_dir / "summary.md").is_file():
        return
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "alignfl.fl_app.sweep",
            "-m",
            *SWEEP,
            f"mlflow_uri={uri}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=ROOT,
        env=env,
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the sweep, the servers' logs, the shots")
    parser.add_argument("--figures", type=Path, default=None, help="also copy the screenshots here")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep_dir, uri = out / "sweep", f"sqlite:///{out / 'mlflow.db'}"
    run_sweep(sweep_dir, uri)
    bin_dir = Path(sys.executable).parent
    board, ui = free_port(), free_port()
    board_url, ui_url = f"http://127.0.0.1:{board}", f"http://127.0.0.1:{ui}"
    parent = json.loads((sweep_dir / "mlflow-sweep.json").read_text())["run-id"]
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("alignfl").experiment_id
    children = [
        run.info.run_id
        for run in client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    ]
    compare = "/#/compare-runs?" + urllib.parse.urlencode(
        {"runs": json.dumps(children), "experiments": json.dumps([experiment])}
    )
    with (
        serving(
            [str(bin_dir / "tensorboard"), "--logdir", str(sweep_dir), "--host", "127.0.0.1", "--port", str(board)],
            board_url,
            out / "tensorboard.log",
        ),
        serving(
            [
                str(bin_dir / "mlflow"),
                "ui",
                "--backend-store-uri",
                uri,
                "--host",
                "127.0.0.1",
                "--port",
                str(ui),
                "--workers",
                "1",
            ],
            ui_url + "/health",
            out / "mlflow.log",
        ),
    ):
        screenshot(
            f"{board_url}/?pinnedCards=&tagFilter=%5Eaccuracy%24%7Clocal-accuracy-mean%7C%5Eloss#scalars",
            out / "tensorboard-scalars.png",
        )
        screenshot(f"{board_url}/#hparams", out / "tensorboard-hparams.png")
        screenshot(ui_url + compare, out / "mlflow-compare.png", "1400,1100")
    if args.figures is not None:
        for name in SHOTS:
            shutil.copy(out / f"{name}.png", args.figures / f"tracking-{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
