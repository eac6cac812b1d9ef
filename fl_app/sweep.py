"""Hydra entry point: one in-process Flower simulation per Hydra job.

    python -m fl_app.sweep pan.mode=mul pan.t=4 pan.a=0.1 data.alpha=0.1 seed=1
    python -m fl_app.sweep -m pan.mode=mul pan.t=1,4,8 pan.a=0,0.05,0.1 data.alpha=0.1,1.0 seed=0,1,2

The composed Hydra config (``conf/``) becomes run-config keys through
:data:`HYDRA_TO_RUN_CONFIG` and is validated by :func:`fl_app.config.parse_run_config`,
the schema ``flwr run`` uses, so a wrong value fails with the same message
either way. A multirun checks every job's config before the first job trains
(:class:`ValidateSweep`). Each job writes its run folder ``<job dir>/run`` and a
``job.json`` (status, error, wall time) that :mod:`fl_app.sweep_report` reads; a
job that fails is logged and recorded, and the sweep goes on.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import ray
import torch
from flwr.simulation import run_simulation
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fl_app.client_app import build_client_app
from fl_app.config import ConfigError, RunConfig, parse_run_config, results_root
from core.data import DatasetMissingError, check_dataset_available
from fl_app.results import write_json
from fl_app.server_app import build_server_app

log = logging.getLogger(__name__)

#: Hydra path → run-config key, one row per key. The keys ``strategy`` and ``model`` are not paths:
#: they are the choices of the config groups of the same names (:data:`GROUP_CHOICES`), whose option
#: files hold that strategy's or model's own settings. A path absent from the composed config
#: (``strategy.proximal_mu`` unless ``strategy=fedprox``) leaves its key at the schema's default.
HYDRA_TO_RUN_CONFIG: dict[str, str] = {
    "dataset": "dataset",
    "seed": "seed",
    "device": "device",
    "init": "init",
    "log_divergence": "log-divergence",
    "resume_from": "resume-from",
    "strategy.proximal_mu": "proximal-mu",
    "strategy.server_lr": "server-lr",
    "strategy.server_momentum": "server-momentum",
    "strategy.moon_mu": "moon-mu",
    "strategy.moon_tau": "moon-tau",
    "strategy.ditto_lambda": "ditto-lambda",
    "strategy.match_cost": "match-cost",
    "strategy.match_reference": "match-reference",
    "strategy.match_iterations": "match-iterations",
    "strategy.retrain_epochs": "retrain-epochs",
    "strategy.superfed_mode": "superfed-mode",
    "strategy.superfed_nu": "superfed-nu",
    "strategy.superfed_mu": "superfed-mu",
    "strategy.superfed_start": "superfed-start",
    "strategy.superfed_val_fraction": "superfed-val-fraction",
    "model.psi_groups": "psi-groups",
    "model.psi_depth": "psi-depth",
    "model.width_factor": "width-factor",
    "pan.mode": "pan-mode",
    "pan.t": "pan-t",
    "pan.a": "pan-a",
    "data.root": "data-root",
    "data.partitioner": "partitioner",
    "data.alpha": "dirichlet-alpha",
    "data.classes_per_client": "classes-per-client",
    "data.shards_per_client": "shards-per-client",
    "data.test_fraction": "test-fraction",
    "data.fraction": "data-fraction",
    "data.holdout_clients": "holdout-clients",
    "data.label_noise": "label-noise",
    "data.label_noise_rate": "label-noise-rate",
    "train.rounds": "num-server-rounds",
    "train.local_epochs": "local-epochs",
    "train.batch_size": "batch-size",
    "train.lr": "lr",
    "train.lr_decay": "lr-decay",
    "train.momentum": "momentum",
    "train.weight_decay": "weight-decay",
    "train.fraction_train": "fraction-train",
    "train.fraction_evaluate": "fraction-evaluate",
    "train.round_timeout": "round-timeout",
}
#: Config group → the run-config key its choice sets.
GROUP_CHOICES: dict[str, str] = {"strategy": "strategy", "model": "model"}
#: Run-config keys each job sets itself: every node must join, and the run folder goes in the job's folder.
SET_PER_JOB = ("min-available-nodes", "results-dir", "run-name")
#: Top-level sections of the Hydra config that are not run-config keys.
NOT_RUN_CONFIG = ("sim", "hydra")
RUN_NAME = "run"
JOB_RECORD = "job.json"
COMPLETED, FAILED = "completed", "failed"


@dataclass(frozen=True)
class SimSettings:
    """How one job's simulation uses the machine (``sim.*``, defaults in conf/sim/default.yaml; not run-config keys)."""

    num_supernodes: int
    client_cpus: float
    client_gpus: float
    ray_cpus: int | None
    ray_gpus: float | None
    torch_threads: int | None

    @classmethod
    def from_config(cls, sim: Mapping[str, Any]) -> SimSettings:
        """Check ``sim.*`` the way the schema checks run-config keys: name the key, the value, what is allowed."""
        known = set(cls.__dataclass_fields__)
        if set(sim) != known:
            raise ConfigError(f"sim has key(s) {sorted('sim.' + k for k in set(sim) - known)} it does not know and "
                              f"lacks {sorted('sim.' + k for k in known - set(sim))}; "
                              f"the keys are {sorted('sim.' + k for k in known)}")
        settings = cls(**sim)
        _check_number("sim.num_supernodes", settings.num_supernodes, integer=True, positive=True)
        _check_number("sim.client_cpus", settings.client_cpus, positive=True)
        _check_number("sim.client_gpus", settings.client_gpus)
        for key in ("ray_cpus", "torch_threads"):
            if getattr(settings, key) is not None:
                _check_number(f"sim.{key}", getattr(settings, key), integer=True, positive=True)
        if settings.ray_gpus is not None:
            _check_number("sim.ray_gpus", settings.ray_gpus)
        if settings.ray_cpus is not None and settings.client_cpus > settings.ray_cpus:
            raise ConfigError(f"sim.client_cpus = {settings.client_cpus} is not allowed: must be at most "
                              f"sim.ray_cpus = {settings.ray_cpus}, or no client could ever be scheduled")
        return settings

    def backend_config(self) -> dict[str, Any]:
        """Flower's ``backend_config``: resources per client, and a cap on this job's Ray."""
        init_args = {key: value for key, value in (("num_cpus", self.ray_cpus), ("num_gpus", self.ray_gpus))
                     if value is not None}
        return {"client_resources": {"num_cpus": self.client_cpus, "num_gpus": self.client_gpus},
                "init_args": init_args}


def _check_number(key: str, value: Any, *, integer: bool = False, positive: bool = False) -> None:
    kind = int if integer else (int, float)
    allowed = f"must be a{' positive' if positive else ' non-negative'} {'integer' if integer else 'number'}"
    if (isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):
        raise ConfigError(f"'{key}' = {value!r} is not allowed: {allowed}")


def _leaves(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"pan": {"t": 4}}`` → ``{"pan.t": 4}``."""
    leaves: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            leaves.update(_leaves(value, f"{path}."))
        else:
            leaves[path] = value
    return leaves


def hydra_to_run_config(cfg: DictConfig, choices: Mapping[str, Any]) -> dict[str, Any]:
    """The run-config keys a composed Hydra config sets; a path that maps to no key is refused."""
    sections = [key for key in cfg if key not in NOT_RUN_CONFIG]
    container = OmegaConf.to_container(OmegaConf.masked_copy(cfg, sections), resolve=True)
    assert isinstance(container, dict)
    leaves = _leaves(container)
    unmapped = sorted(set(leaves) - set(HYDRA_TO_RUN_CONFIG))
    if unmapped:
        raise ConfigError(f"Hydra key(s) {unmapped} map to no run-config key; "
                          f"known keys: {sorted(HYDRA_TO_RUN_CONFIG)} (see fl_app/sweep.py)")
    return {**{key: choices[group] for group, key in GROUP_CHOICES.items()},
            **{HYDRA_TO_RUN_CONFIG[path]: value for path, value in leaves.items()}}


def job_settings(cfg: DictConfig, choices: Mapping[str, Any], results_dir: Path) -> tuple[RunConfig, SimSettings]:
    """The validated run config (its run folder in ``results_dir``) and simulation settings of one job."""
    sim = SimSettings.from_config(OmegaConf.to_container(cfg.sim, resolve=True))  # type: ignore[arg-type]
    values = {**hydra_to_run_config(cfg, choices), "min-available-nodes": sim.num_supernodes,
              "results-dir": str(results_dir.resolve()), "run-name": RUN_NAME}
    return parse_run_config(values), sim


def sweep_job_overrides(config: DictConfig) -> list[list[str]]:
    """Every job's overrides, expanded as Hydra's basic sweeper expands them (its params, then the command line)."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(arguments), None) for job in batch]


def validate_sweep(config: DictConfig) -> int:
    """Compose and validate every job of a multirun, then check each dataset it needs is on disk.

    Raises the schema's :class:`ConfigError` (prefixed with the job's overrides) at the first bad job;
    returns the number of jobs.
    """
    loader = GlobalHydra.instance().config_loader()
    sweep_dir = Path(config.hydra.sweep.dir)
    jobs = sweep_job_overrides(config)
    datasets = set()
    for overrides in jobs:
        job_cfg = loader.load_sweep_config(config, overrides)
        try:
            run_config, _ = job_settings(job_cfg, job_cfg.hydra.runtime.choices, sweep_dir)
        except ConfigError as error:
            raise ConfigError(f"sweep job {' '.join(overrides) or '(no overrides)'}: {error}") from None
        datasets.add((run_config.dataset, run_config.data_root or None))
    for name, root in sorted(datasets, key=str):
        check_dataset_available(name, root)
    return len(jobs)


class ValidateSweep(Callback):
    """Refuse a multirun, before any job trains, when one of its jobs has a config the schema rejects."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = OmegaConf.select(config, "hydra.sweeper._target_") or ""
        if not target.endswith(".BasicSweeper"):
            log.warning("sweeper %s: each job's config is validated when the job starts", target)
            return
        try:
            count = validate_sweep(config)
        except (ConfigError, DatasetMissingError) as error:
            # Hydra turns a callback's exception into a warning and carries on; exiting is the way to stop.
            raise SystemExit(f"invalid sweep, no job was started: {error}") from None
        except Exception as error:  # a sweep that cannot be checked is not started either
            log.error("validating the sweep failed:\n%s", traceback.format_exc())
            raise SystemExit(f"could not validate the sweep, no job was started: {type(error).__name__}: {error}") from None
        log.info("all %d jobs of the sweep passed the run-config schema", count)


def simulate(config: RunConfig, sim: SimSettings) -> None:
    """Run one in-process simulation; everything reaches the apps through their factories."""
    if sim.torch_threads is not None:
        torch.set_num_threads(sim.torch_threads)
    values = config.to_run_config()
    run_simulation(server_app=build_server_app(values), client_app=build_client_app(values),
                   num_supernodes=sim.num_supernodes, backend_config=sim.backend_config())


def run_job(cfg: DictConfig, choices: Mapping[str, Any], job_dir: Path) -> dict[str, Any]:
    """Validate, simulate and record one job; an error is logged and recorded, never raised."""
    started = time.time()
    record: dict[str, Any] = {"status": FAILED, "error": None, "run-folder": None}
    try:
        config, sim = job_settings(cfg, choices, job_dir)
        run_folder = Path(config.resume_from) if config.resume_from else results_root(config) / config.run_name
        if run_folder.exists() and not config.resume_from:  # its metrics.jsonl would get a second run's rounds
            raise FileExistsError(f"{run_folder} holds an earlier run; give the sweep a new hydra.sweep.dir")
        simulate(config, sim)
        if not (run_folder / "summary.json").is_file():
            raise RuntimeError(f"the simulation ended without writing {run_folder / 'summary.json'}")
        record.update(status=COMPLETED, **{"run-folder": str(run_folder)})
    except Exception as error:  # a failed job is reported and the sweep goes on
        log.error("job in %s failed:\n%s", job_dir, traceback.format_exc())
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        # Flower stops Ray when a simulation ends normally; after an error it may not have.
        if ray.is_initialized():
            ray.shutdown()
        record["job-wall-time-s"] = time.time() - started
        job_dir.mkdir(parents=True, exist_ok=True)
        write_json(job_dir / JOB_RECORD, record)
    return record


class JobFailed(RuntimeError):
    """A single (non-multirun) job failed: the command exits non-zero."""


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> str:
    """One Hydra job; returns its status (a multirun's report is written by ``fl_app.sweep_report``)."""
    hydra_config = HydraConfig.get()
    record = run_job(cfg, hydra_config.runtime.choices, Path(hydra_config.runtime.output_dir))
    if record["status"] == FAILED and hydra_config.mode == RunMode.RUN:
        raise JobFailed(record["error"])
    return record["status"]


if __name__ == "__main__":
    main()
