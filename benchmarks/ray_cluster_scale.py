"""Scale on a Ray cluster: 1,000 clients, 1 % per round, on two Ray nodes against the same on one node.

Both clusters are started on this machine (:mod:`alignfl.fl_app.runtime.local_ray`) with the same total CPUs: one node
with ``2 * cpus`` CPUs, or a head and a second node with ``cpus`` each. The simulation (the product's ServerApp and
ClientApp on Flower's own simulation engine, :func:`benchutil.simulate`) joins the cluster from this process, so
the driver measured is the ServerApp and the engine. ``python -m alignfl.fl_app.sweep sim.backend=ray
sim.ray_address=...`` runs the same engine through ``flwr run``, whose driver is another process. Per layout: each round's time (``elapsed-s`` differences), where the
clients trained (``client-ray-nodes``), and the peak memory of each node's processes (GCS, raylet, agents,
ClientApp workers; PSS, shared pages split among their users) and of this driver process, sampled every second.

    .venv/bin/python benchmarks/ray_cluster_scale.py --rounds 5 --cpus 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchutil import append_jsonl, machine, round_seconds, run_metrics, simulate, write_report

from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.runtime.local_ray import local_ray_cluster

EXPERIMENT = {
    "strategy": "fedavg",
    "model": "mlp",
    "dataset": "fashion-mnist",
    "partitioner": "dirichlet",
    "dirichlet-alpha": 0.3,
    "local-epochs": 1,
    "batch-size": 64,
    "seed": 0,
    "fraction-train": 0.01,
    "fraction-evaluate": 0.01,
}
CLIENTS = 1000
OUT = Path.home() / "alignfl-results" / "benchmarks" / "ray_cluster_scale"


class NodeMemory:
    """Peak PSS (MiB) of each node's process tree and of this process, sampled every ``interval`` seconds."""

    def __init__(self, cluster: Any, interval: float = 1.0) -> None:
        import psutil
        import ray  # noqa: F401  (Ray ships psutil and puts it on sys.path)

        self.psutil, self.cluster, self.interval = psutil, cluster, interval
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _pss(self, pids: list[int]) -> float:
        total = 0
        for pid in pids:
            try:
                total += self.psutil.Process(pid).memory_full_info().pss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
        return total / 2**20

    def _run(self) -> None:
        import os

        while not self._stop.is_set():
            readings = {f"node{i}": self._pss(list(tree.refresh())) for i, tree in enumerate(self.cluster.trees)}
            readings["driver"] = self._pss([os.getpid()])
            for name, value in readings.items():
                self.peaks[name] = max(self.peaks.get(name, 0.0), value)
            self._stop.wait(self.interval)

    def __enter__(self) -> NodeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_layout(layout: str, cpus: int, rounds: int, results: Path) -> dict[str, Any]:
    nodes = [2 * cpus] if layout == "one node" else [cpus, cpus]
    name = layout.replace(" ", "-")
    with local_ray_cluster(nodes) as cluster:
        node_ids = {node.node_id: label for label, node in cluster.nodes().items()}
        config = parse_run_config(
            {
                **EXPERIMENT,
                "num-server-rounds": rounds,
                "results-dir": str(results),
                "run-name": name,
                "min-available-nodes": CLIENTS,
            }
        )
        started = time.time()
        with NodeMemory(cluster) as memory:
            simulate(config.to_run_config(), CLIENTS, None, ray_address=cluster.address)
        wall = time.time() - started
    rows = run_metrics(results, name)
    placed: dict[str, int] = {}
    for row in rows:
        for client in row.get("client-ray-nodes", {}).values():
            label = node_ids.get(client["node-id"], client["node-id"])
            placed[label] = placed.get(label, 0) + 1
    return {
        "layout": layout,
        "cpus-per-node": nodes,
        "rounds": rounds,
        "wall-s": wall,
        "round-s": round_seconds(rows),
        "clients-trained": [r.get("clients-trained") for r in rows[1:]],
        "trainings-per-node": placed,
        "peak-pss-mib": memory.peaks,
        "final-accuracy": rows[-1]["accuracy"],
        "machine": machine(),
    }


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | CPUs per node | rounds | round time (s), each round | trainings per node | "
        "peak PSS per node (MiB) | driver peak PSS (MiB) | final accuracy | load (1/5/15 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        nodes = {k: v for k, v in row["peak-pss-mib"].items() if k != "driver"}
        lines.append(
            f"| {row['layout']} | {row['cpus-per-node']} | {row['rounds']} | "
            f"{', '.join(f'{s:.1f}' for s in row['round-s'])} | {row['trainings-per-node']} | "
            f"{', '.join(f'{k} {v:.0f}' for k, v in nodes.items())} | {row['peak-pss-mib']['driver']:.0f} | "
            f"{row['final-accuracy']:.4f} | {row['machine']['load-average-1-5-15']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of each of the two nodes (one node: twice)")
    parser.add_argument("--layouts", nargs="+", default=["two nodes", "one node"])
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows_path = OUT / "rows.jsonl"
    for layout in args.layouts:
        with tempfile.TemporaryDirectory(prefix="alignfl-ray-scale-") as results:
            row = run_layout(layout, args.cpus, args.rounds, Path(results))
        print(json.dumps(row), flush=True)
        append_jsonl(rows_path, row)
    return write_report(OUT, rows_path, report)


if __name__ == "__main__":
    raise SystemExit(main())
