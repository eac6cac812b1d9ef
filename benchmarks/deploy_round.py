"""How long a round of the loopback deployment takes, and where it goes (issue 18 item 4).

Runs ``python -m fl_app.deploy`` (SuperLink, N SuperNodes and their SuperExecs on 127.0.0.1) for a few rounds
of a tiny model and reads each round's wall time off the run's ``metrics.jsonl`` (``elapsed-s`` is written when a
round ends). Beside it, the parts of a message's cost that a round pays per message, each measured in fresh
processes as a ClientApp process would: starting Python and importing Flower's ``flwr-clientapp`` entry point,
importing the project's ClientApp, and loading the data and partitions. The SuperNode's poll for messages
(Flower sleeps 3 s when it found none) is not ours to change: it is reported as the expected wait, 1.5 s per
message.

    python benchmarks/deploy_round.py --rounds 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchutil import append_jsonl, machine, median, write_report

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
POLL_WAIT_S = 1.5
"""Expected wait of a message for the SuperNode's next poll: Flower sleeps 3 s after finding no message."""

PARTS = {
    "python + flwr clientapp entry point": "import flwr.supernode.cli",
    "+ the project's ClientApp (imports)": "import flwr.supernode.cli, fl_app.client_app",
    "+ data and partitions": (
        "import flwr.supernode.cli, fl_app.client_app as c; from fl_app.config import parse_run_config;"
        " cfg = parse_run_config({'dataset': 'digits', 'data-root': ''}); c.client_data(cfg, 0, 3)"
    ),
}


def time_part(code: str) -> float:
    """Wall seconds of a fresh interpreter running ``code`` (what one ClientApp process pays for it)."""
    start = time.perf_counter()
    subprocess.run([PYTHON, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - start


def deploy_rounds(nodes: int, rounds: int, run_config: str, work: Path) -> list[float]:
    """Wall seconds of rounds 1..``rounds`` of one deployed run (round 1 includes asking nodes their partition)."""
    results = work / "results"
    overrides = f'dataset="digits" results-dir="{results}" run-name="bench" {run_config}'.strip()
    subprocess.run([PYTHON, "-m", "fl_app.deploy", "--num-supernodes", str(nodes), "--rounds", str(rounds),
                    "--run-config", overrides, "--work-dir", str(work / "deploy")], cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (results / "bench" / "metrics.jsonl").read_text().splitlines()]
    ends = {int(row["round"]): float(row["elapsed-s"]) for row in rows}  # round 0: the initial model's evaluation
    return [ends[r] - ends[r - 1] for r in range(1, rounds + 1)]


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| kind | what | median s | samples | load (1 min) |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['what']} | {median(row['seconds']):.2f} | "
                     f"{', '.join(f'{s:.2f}' for s in row['seconds'])} | {row['machine']['load-average-1-5-15'][0]} |")
    lines.append(f"| poll | SuperNode's expected wait per message (Flower sleeps 3 s when idle) | {POLL_WAIT_S:.2f} | "
                 "- | - |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-config", default="", help="extra 'key=value ...' overrides")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "alignfl-deploy-round")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    for what, code in PARTS.items():
        seconds = [time_part(code) for _ in range(args.repeats)]
        append_jsonl(rows_path, {"kind": "per message", "what": what, "seconds": seconds, "machine": machine()})
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="alignfl-deploy-round-") as work:
            per_round = deploy_rounds(args.nodes, args.rounds, args.run_config, Path(work))
        append_jsonl(rows_path, {"kind": "round 1" , "what": f"run {repeat}: {args.nodes} nodes, round 1",
                                 "seconds": per_round[:1], "machine": machine()})
        append_jsonl(rows_path, {"kind": "rounds 2+", "what": f"run {repeat}: {args.nodes} nodes, rounds 2-{args.rounds}",
                                 "seconds": per_round[1:], "machine": machine()})
    return write_report(args.out, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
