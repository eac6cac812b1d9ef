"""Run the app with ``flwr run`` on a private local SuperLink and exit with the run's real outcome.

``flwr run --stream`` exits 0 even when the run failed, a detached SuperLink keeps
the environment of whoever started it, and the app runs from a copy in another
directory. This launcher therefore validates the run config first, starts its
own SuperLink (:func:`alignfl.fl_app.runtime.superlink.local_superlink`: own Flower home, free
ports, the settings the app needs), submits the run, streams its log, reads the
final status (:mod:`alignfl.fl_app.runtime.flwr_cli`), checks the run folder, and stops the
SuperLink it started by process id, with every process it started in turn (its
SuperExec, ``flwr-simulation``, Ray), also on SIGTERM, SIGINT (Ctrl-C) or SIGHUP,
after which it exits with 128 + the signal's number (:mod:`alignfl.fl_app.runtime.processes`).

    python -m alignfl.fl_app.launch --num-supernodes 10 --run-config "num-server-rounds=5 dirichlet-alpha=0.1"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alignfl.core.config import default_results_root
from alignfl.core.data import DatasetMissingError, check_dataset_available
from alignfl.core.partitioning.partitions import partition_dataset
from alignfl.fl_app.checkpoint import checkpointed_round, resume_checkpoint, run_folder
from alignfl.fl_app.config import ConfigError, RunConfig, parse_run_config, validate_run
from alignfl.fl_app.engines.batched import ray_options, run_batched, workers_allowed
from alignfl.fl_app.engines.grid import VECTORISE_CHOICES, RayOptions
from alignfl.fl_app.locations import checkout_root, program
from alignfl.fl_app.runtime.common import scratch_folder
from alignfl.fl_app.runtime.flwr_cli import parse_overrides, submit_and_follow
from alignfl.fl_app.runtime.keys import refuse_exposed_keys
from alignfl.fl_app.runtime.processes import Stopped, stop_signals
from alignfl.fl_app.runtime.ray_cluster import attach_to_cluster
from alignfl.fl_app.runtime.superlink import flower_environment, local_superlink

FLWR_HOME_PREFIX = "alignfl-flwr-home-"
"""The temporary Flower home of a private local SuperLink (in ``$TMPDIR``), removed when its run ends."""
RAY_TMP_PREFIX = "alfl-ray-"
"""The temporary folder of the Ray a run starts (its ``RAY_TMPDIR``, in ``$TMPDIR``, or ``/tmp`` where that is too
long for Ray's socket paths), removed when its run ends: Ray keeps its session folders after it stops."""


PATH_KEYS = ("results-dir", "resume-from", "data-root")
"""Run-config keys that name folders: the apps take them absolute only (they run from a copy elsewhere), so the
launcher and the deployment resolve a relative one against the current folder first."""


def absolute_paths(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` with each relative folder of :data:`PATH_KEYS` resolved against the current folder."""
    return {
        key: str(Path(value).expanduser().absolute())
        if key in PATH_KEYS and isinstance(value, str) and value
        else value
        for key, value in overrides.items()
    }


def prepare_config(overrides: dict[str, Any], num_supernodes: int) -> RunConfig:
    """Validate before anything starts; give the run an absolute results folder and a known name.

    Unless set, ``min-available-nodes`` is every simulated node, so each round samples from all of them; a
    relative folder (:data:`PATH_KEYS`) is one under the current folder.
    """
    if num_supernodes < 1:  # before min-available-nodes' default, which would otherwise be blamed
        raise ConfigError(f"--num-supernodes must be at least 1, got {num_supernodes}")
    defaults = {"results-dir": str(default_results_root()), "min-available-nodes": num_supernodes}
    config = parse_run_config({**defaults, **absolute_paths(overrides)})
    if not config.run_name:
        config = config.replace(
            run_name=f"{datetime.now(UTC):%Y%m%d-%H%M%S}_{config.strategy}_"
            f"{config.model}_{config.dataset}_seed{config.seed}"
        )
    if config.min_available_nodes > num_supernodes:
        raise ConfigError(
            f"run-config key 'min-available-nodes' = {config.min_available_nodes} exceeds "
            f"--num-supernodes={num_supernodes}: the run would wait forever"
        )
    validate_run(config, num_supernodes)  # folders first: an unusable results-dir or data-root is named as such
    check_dataset_available(config.dataset, config.data_root or None)
    if config.resume_from:
        resume_checkpoint(config)  # a missing checkpoint or a changed key is refused here, not after submission
    partition_dataset(
        config.dataset,
        config.data_root or None,
        config.partitioner,
        num_supernodes,
        config.seed,
        **config.partition_options(),
    )  # an infeasible split fails here, not in every client
    return config


def torch_cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported here only: the launcher starts in a second)."""
    import torch

    return torch.cuda.is_available()


def check_client_resources(num_cpus: int, num_gpus: float, cuda_available: bool) -> None:
    """Refuse client resources that Ray cannot schedule, before a SuperLink starts: Flower only finds out
    inside the run (an empty actor pool), after ``flwr run`` has already reported the submission."""
    if num_cpus < 1:
        raise ConfigError(f"--num-cpus={num_cpus} is not allowed: CPU cores per client must be an integer >= 1")
    if not num_gpus >= 0:
        raise ConfigError(
            f"--num-gpus={num_gpus} is not allowed: GPUs per client must be >= 0 "
            "(a fraction such as 0.25 puts four clients on one GPU)"
        )
    if not math.isfinite(num_gpus) or (num_gpus > 1 and num_gpus != int(num_gpus)):
        raise ConfigError(f"--num-gpus={num_gpus} is not allowed: above 1, Ray hands out whole GPUs only")
    if num_gpus > 0 and not cuda_available:
        raise ConfigError(
            f"--num-gpus={num_gpus} but torch sees no CUDA device here, so no client could be "
            "scheduled; use --num-gpus 0 (clients then train on CPU)"
        )


def check_workers(workers: int | None) -> None:
    """Refuse a count of Ray actor workers the batched engine cannot start (the sweep's ``sim.workers`` check)."""
    if not workers_allowed(workers):
        raise ConfigError(
            f"--workers={workers} is not allowed: must be a positive integer (that many Ray actors as the batched "
            "engine's workers); leave it out for one worker in this process"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program("alignfl.fl_app.launch"), description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", default="", help="'key=value ...' overrides of [tool.flwr.app.config]")
    parser.add_argument("--num-supernodes", type=int, default=10, help="number of simulated clients (default 10)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPU cores reserved per simulated client")
    parser.add_argument(
        "--num-gpus",
        type=float,
        default=0.0,
        help="GPUs per simulated client; fractions share one GPU (e.g. 0.25 = 4 clients per GPU)",
    )
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or None,
        help="run the clients on this running Ray cluster (HOST:PORT of its head, or auto; default "
        "$RAY_ADDRESS): its nodes' resources, not this machine's, decide where clients run",
    )
    parser.add_argument(
        "--backend",
        choices=("flwr", "batched"),
        default="flwr",
        help="flwr: `flwr run` on a private SuperLink (default); batched: the batched engine in this process, a "
        "round's messages at once to long-lived workers (Ray actors with --workers, --ray-address or --num-gpus)",
    )
    parser.add_argument(
        "--vectorise",
        choices=VECTORISE_CHOICES,
        default=None,
        help="batched: on trains a round's clients as one stacked update where the algorithm and the model allow "
        "it; auto (default) only where they also train on CUDA (stacking was not faster on a CPU); off: never",
    )
    parser.add_argument("--workers", type=int, default=None, help="batched: this many Ray actors as workers")
    args = parser.parse_args(argv)
    for option in ("workers", "vectorise"):  # the flwr backend has no use for them: say so, not ignore them
        if args.backend != "batched" and getattr(args, option) is not None:
            parser.error(f"--{option} needs --backend batched")
    args.vectorise = args.vectorise or "auto"
    config = None
    try:
        with stop_signals():
            try:
                check_workers(args.workers)
                refuse_exposed_keys(checkout_root())  # keys a `git add` of the checkout would publish
                if args.ray_address:
                    args.ray_address = attach_to_cluster(
                        args.ray_address, "--ray-address", args.num_cpus, args.num_gpus
                    )
                check_client_resources(args.num_cpus, args.num_gpus, bool(args.ray_address) or torch_cuda_available())
                config = prepare_config(parse_overrides(args.run_config), args.num_supernodes)
            except (ValueError, DatasetMissingError) as error:  # ConfigError is a ValueError
                print(f"[alignfl] refused before starting: {error}", file=sys.stderr)
                return 2
            if args.backend == "batched":
                status, details = run_batched_here(config, args)
            else:
                status, details = run_on_local_superlink(config, args)
    except Stopped as stop:
        print(
            f"[alignfl] stopped by {stop}: every process the launcher started has been stopped.{resume_hint(config)}",
            file=sys.stderr,
        )
        return stop.exit_code
    except RuntimeError as error:  # the SuperLink did not start
        print(f"[alignfl] FAILED: {error}", file=sys.stderr)
        return 1
    return report_outcome(config, status, details)


def run_on_local_superlink(config: RunConfig, args: argparse.Namespace) -> tuple[str, str]:
    """Start a private SuperLink, run the experiment on it, stop everything; the run's final status."""
    federation = {
        "num-supernodes": args.num_supernodes,
        "client-resources-num-cpus": args.num_cpus,
        "client-resources-num-gpus": args.num_gpus,
    }
    return simulate_on_local_superlink(config.to_run_config(), federation, args.ray_address)


def simulate_on_local_superlink(
    run_config: Mapping[str, Any], federation: Mapping[str, Any], ray_address: str | None = None
) -> tuple[str, str]:
    """Flower's simulation runtime on a private local SuperLink, what Flower recommends in place of its
    deprecated ``run_simulation``: ``flwr run`` of the project, its log streamed here, everything stopped after.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        The run config (``[tool.flwr.app.config]`` keys).
    federation : Mapping[str, Any]
        Flower's simulation config (``num-supernodes``, ``client-resources-num-cpus``,
        ``client-resources-num-gpus``, ``init-args-num-cpus``, ``init-args-num-gpus``).
    ray_address : str or None
        A running Ray cluster the simulation joins (``RAY_ADDRESS``); None: a Ray of its own.

    Returns
    -------
    tuple[str, str]
        The run's final status (``finished:completed`` when it completed) and its details.
    """
    overrides = " ".join(f"{key}={value}" for key, value in federation.items())
    # a caller without its own stop_signals (a sweep job) still stops everything on SIGTERM or SIGHUP
    with stop_signals(), scratch_folder(FLWR_HOME_PREFIX) as flwr_home:
        env = flower_environment(flwr_home)
        if ray_address:
            env["RAY_ADDRESS"] = ray_address  # Flower's ray.init() joins the cluster
        with own_ray_temp(env), local_superlink(env) as watch:
            return submit_and_follow(run_config, env, ["--federation-config", overrides], watch)


def run_batched_here(config: RunConfig, args: argparse.Namespace) -> tuple[str, str]:
    """Run the experiment on the batched engine in this process (Ray actors as workers when asked for, or where
    GPUs are shared); the run's final status as ``flwr ls`` would give it."""
    options = ray_options(args.workers, args.ray_address, args.num_cpus, args.num_gpus)
    if options is None and args.num_gpus > 0:  # fractional GPUs are Ray's to hand out: as many workers as fit
        options = RayOptions(worker_cpus=args.num_cpus, worker_gpus=args.num_gpus)
    starts_ray = options is not None and options.address is None
    try:
        with own_ray_temp(os.environ) if starts_ray else nullcontext():
            run_batched(config.to_run_config(), args.num_supernodes, args.vectorise, options)
    except Exception as error:
        return "finished:failed", f"{type(error).__name__}: {error}"
    return "finished:completed", ""


@contextmanager
def own_ray_temp(env: MutableMapping[str, str]) -> Iterator[None]:
    """A Ray started within the block with ``env`` keeps its session folder, which outlives it, in a scratch folder
    removed after the block (``RAY_TMPDIR`` in ``env`` meanwhile); unless ``env`` joins a running Ray
    (``RAY_ADDRESS``) or already names Ray's folder (``RAY_TMPDIR``: the user's choice, left to them)."""
    if "RAY_ADDRESS" in env or "RAY_TMPDIR" in env:
        yield
        return
    with scratch_folder(RAY_TMP_PREFIX, short=True) as folder:
        env["RAY_TMPDIR"] = str(folder)
        try:
            yield
        finally:
            del env["RAY_TMPDIR"]


def resume_hint(config: RunConfig | None) -> str:
    """How to continue a stopped run, if it checkpointed a round."""
    done = checkpointed_round(config) if config is not None else None
    if done is None:
        return ""
    return (
        f' Rounds up to {done} are checkpointed; add resume-from="{run_folder(config)}" to --run-config to '
        "continue the run."
    )


def report_outcome(config: RunConfig, status: str, details: str) -> int:
    """Print the run's outcome and where its results are; the exit code: 0 only for a completed run
    whose summary was written."""
    folder = run_folder(config)
    summary = folder / "summary.json"
    if status != "finished:completed" or not summary.exists():
        print(f"[alignfl] run FAILED ({status}): {details}", file=sys.stderr)
        return 1
    result = json.loads(summary.read_text())
    print(
        f"[alignfl] run completed: final accuracy {result['final-accuracy']:.4f} "
        f"(best {result['best-accuracy']:.4f}); results in {folder}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
