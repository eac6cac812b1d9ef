"""What the performance benchmarks share: the machine's description, timing statistics, the resident
memory of a whole process tree, and Flower's own Ray simulation of the product's apps.

Imported by the scripts beside it (``python benchmarks/<script>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

RUN_SIMULATION = "flwr.simulation.run_simulation"


def machine() -> dict[str, Any]:
    """Cores, torch threads, load average and Python/torch versions: what a timing needs beside it."""
    return {
        "cpu-cores": os.cpu_count(),
        "torch-threads": torch.get_num_threads(),
        "omp-num-threads": os.environ.get("OMP_NUM_THREADS"),
        "load-average-1-5-15": [round(value, 2) for value in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def median(values: Sequence[float]) -> float:
    """The median of the values that are numbers (a sample that missed a round is NaN); NaN for none, so
    a benchmark that measured nothing does not look fast."""
    numbers = [value for value in values if not math.isnan(value)]
    return statistics.median(numbers) if numbers else float("nan")


def append_jsonl(path: Path, row: Mapping[str, Any]) -> None:
    """Append one measurement at once, so an interrupted benchmark keeps what it finished."""
    with path.open("a") as stream:
        stream.write(json.dumps(row, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_report(out: Path, rows_path: Path, report: Callable[[list[dict[str, Any]]], str]) -> int:
    """Render every row measured so far into ``out/report.md`` and print it; the exit code of a benchmark."""
    text = report(read_jsonl(rows_path))
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


def run_metrics(results_dir: Path, run_name: str) -> list[dict[str, Any]]:
    """The rows of a finished run's ``metrics.jsonl``."""
    return read_jsonl(results_dir / run_name / "metrics.jsonl")


def round_seconds(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds of rounds 1, 2, ... from the recorder's ``elapsed-s`` stamps (each written after the round's
    server-side evaluation, so a round's time holds training, client evaluation and server evaluation)."""
    stamps = [row["elapsed-s"] for row in sorted(rows, key=lambda row: row["round"])]
    return [later - earlier for earlier, later in zip(stamps, stamps[1:])]


def ray_init_args(ray_cpus: int | None, ray_address: str | None) -> dict[str, Any]:
    """What Flower's backend passes to ``ray.init``: the cluster to join, or the cap on a Ray of its own."""
    if ray_address:
        return {"address": ray_address}
    return {} if ray_cpus is None else {"num_cpus": ray_cpus}


def simulate(
    settings: Mapping[str, Any],
    num_supernodes: int,
    ray_cpus: int | None,
    client_cpus: float = 1.0,
    client_gpus: float = 0.0,
    ray_address: str | None = None,
) -> None:
    """One Flower simulation of the product's ServerApp and ClientApp on Ray, driven from this process.

    Flower's own simulation engine is what the benchmarks that call this measure (``overhead.py``,
    ``scale.py``, ``cross_device.py``'s ``ray``, ``ray_cluster_scale.py``): its driver (the ServerApp and the
    engine) in this process and, on a Ray of its own, Ray's processes its children, which :class:`TreeSampler`
    reads. Flower deprecated the ``run_simulation`` that starts it; the replacement it recommends, ``flwr run``
    on a SuperLink (the launcher's path), would move the driver into another process beside a SuperLink and a
    SuperExec and change what these figures mean, so it is read through :mod:`alignfl.fl_app.patches.seam`.

    ``ray_cpus`` caps a Ray of its own, so at most ``ray_cpus / client_cpus`` clients run at once (None: every
    core); ``ray_address``: join the running cluster there instead. Flower's backend shuts its Ray down (or
    leaves the cluster) at the end.
    """
    from alignfl.fl_app.client_app import build_client_app
    from alignfl.fl_app.patches import seam
    from alignfl.fl_app.server_app import build_server_app

    run_simulation = seam.get(RUN_SIMULATION)
    run_simulation(
        server_app=build_server_app(settings),
        client_app=build_client_app(settings),
        num_supernodes=num_supernodes,
        backend_config={
            "client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus},
            "init_args": ray_init_args(ray_cpus, ray_address),
        },
    )


class TreeSampler:
    """Samples, every ``interval`` seconds in a thread, this process and all its descendants (Ray's GCS,
    raylet and worker processes are children of the driver): their CPU seconds and, with ``memory``,
    their memory.

    Two memory sums are kept: RSS, which counts pages shared between processes (torch's libraries, Ray's
    shared-memory object store) once per process and so overstates, and PSS, which splits each
    shared page among the processes that map it, so its sum is the tree's true footprint. CPU seconds
    (user + system) are summed over the processes alive at the sample, so take differences between
    samples while the same processes live (a simulation's rounds).
    """

    def __init__(self, interval: float = 1.0, tag: Callable[[], Any] | None = None, memory: bool = True) -> None:
        try:
            import psutil
        except ImportError:  # Ray ships psutil in its third-party folder, put on sys.path when Ray is imported
            __import__("ray")
            import psutil

        self._psutil = psutil
        self.interval = interval
        self.tag = tag  # read with each sample, e.g. the round the run is in
        self.memory = memory
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.time()

    def _tree(self) -> list[Any]:
        me = self._psutil.Process()
        return [me, *me.children(recursive=True)]

    def sample(self) -> dict[str, float]:
        """One reading of the whole tree: CPU seconds, and memory in MiB."""
        rss = pss = 0
        cpu = 0.0
        count = 0
        for process in self._tree():
            try:
                times = process.cpu_times()
                if process.pid == os.getpid():  # leave out this sampling thread's own CPU
                    mine = [t for t in process.threads() if t.id == threading.get_native_id()]
                    cpu -= sum(t.user_time + t.system_time for t in mine)
                info = process.memory_full_info() if self.memory else None
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                continue
            cpu, count = cpu + times.user + times.system, count + 1
            if info is not None:
                rss, pss = rss + info.rss, pss + info.pss
        return {
            "t": time.time() - self._started,
            "cpu-s": cpu,
            "rss-mib": rss / 2**20,
            "pss-mib": pss / 2**20,
            "processes": count,
            "tag": self.tag() if self.tag is not None else None,
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, key: str) -> float:
        return max((sample[key] for sample in self.samples), default=float("nan"))

    def first_per_tag(self, key: str) -> dict[Any, float]:
        """``key`` at the first sample of each tag (e.g. CPU seconds when a round began)."""
        first: dict[Any, float] = {}
        for sample in self.samples:
            first.setdefault(sample["tag"], sample[key])
        return first


class RoundCounter:
    """How many rows a run's ``metrics.jsonl`` holds: a sampler's tag, telling which round a sample fell in
    (while it holds r rows, round r runs; round 0 is the initial evaluation)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> int:
        try:
            return self.path.read_text().count("\n")
        except FileNotFoundError:
            return 0
