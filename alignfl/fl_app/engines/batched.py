"""One experiment on the batched engine: the real ServerApp logic over a :class:`BatchedGrid`.

    run_batched({"dataset": "digits", "num-server-rounds": 3}, num_nodes=100)

``vectorise``: ``on`` trains a round's clients stacked where the algorithm and the model allow it, ``auto`` there
only where they also train on CUDA (stacking was not faster on a CPU), ``off`` one after another (the choice and
its reason said once in the log). ``ray``: None keeps one worker in this process; :class:`RayOptions` runs
long-lived Ray actors (on a cluster with ``address``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.engines.grid import (
    BatchedGrid,
    InProcessPool,
    RayOptions,
    WorkerPool,
    describe_choice,
    vectorise_choice,
)
from alignfl.fl_app.server_app import run_experiment


def run_batched(
    values: Mapping[str, Any], num_nodes: int, vectorise: str = "auto", ray: RayOptions | None = None
) -> dict[str, Any]:
    """Run one experiment on ``num_nodes`` simulated nodes; returns its summary."""
    values = {**values, "min-available-nodes": num_nodes}
    config = parse_run_config(values)
    stacked, reason = vectorise_choice(config, vectorise, ray is not None and ray.worker_gpus > 0)
    describe_choice(stacked, reason)
    pool: WorkerPool
    if ray is None:
        pool = InProcessPool(values, stacked)
    else:
        from alignfl.fl_app.engines.ray_workers import RayWorkerPool  # Ray loads in a second: only when asked for

        pool = RayWorkerPool(values, stacked, ray)
    try:
        return run_experiment(BatchedGrid(pool, num_nodes), config)  # type: ignore[arg-type]
    finally:
        pool.close()


def workers_allowed(workers: object) -> bool:
    """Whether the batched engine can start ``workers`` Ray actors (None: none, one worker in this process).

    The launcher and the sweep both ask before anything starts: Ray would only fail once a run folder exists.
    """
    return workers is None or (type(workers) is int and workers > 0)


def ray_options(
    workers: int | None,
    address: str | None,
    client_cpus: float = 1.0,
    client_gpus: float = 0.0,
    ray_cpus: int | None = None,
    ray_gpus: float | None = None,
) -> RayOptions | None:
    """The batched engine's workers as the launcher's and the sweeps' settings ask for them: one worker in this
    process (no ``workers``, no ``address``), else Ray actors of ``client_cpus``/``client_gpus`` each, ``workers``
    of them (None: as many as fit) on a Ray of this process's own or on the cluster at ``address``."""
    if workers is None and address is None:
        return None
    return RayOptions(address, ray_cpus, ray_gpus, client_cpus, client_gpus, workers)
