"""Hydra entry point: one in-process Flower simulation per Hydra job.

    python -m alignfl.fl_app.sweep pan.mode=mul pan.t=4 pan.a=0.1 data.dirichlet_alpha=0.1 seed=1
    python -m alignfl.fl_app.sweep -m pan.mode=mul pan.t=1,4,8 pan.a=0,0.05,0.1 data.dirichlet_alpha=0.1,1.0 seed=0,1,2

The Hydra configs are generated from the settings classes (:func:`register_configs`: the
common sections of :mod:`alignfl.core.config`, every registered algorithm under ``strategy/`` and
every model under ``model/``), so their defaults are the schema's. Paths map onto run-config
keys mechanically (:func:`alignfl.core.config.key_of_path`: ``data.root`` is ``data-root``,
``strategy.fedprox_mu`` is ``fedprox-mu``), and the result is validated by
:func:`alignfl.fl_app.config.parse_run_config`, the schema ``flwr run`` uses. An override of a key
that only an unselected algorithm or model has is refused before Hydra starts, naming its
owner. A single run is checked before Hydra makes its folder, and a multirun checks every
job's config before the first job trains (:class:`ValidateSweep`; both exit with code 2).
Each job writes its run folder ``<job dir>/run`` and a ``job.json`` (status, error, wall
time) that :mod:`alignfl.fl_app.sweeps.report` reads; a job that fails is logged and recorded, and
the sweep goes on.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignfl.core.config import SECTIONS, key_of_path
from alignfl.core.data import DatasetMissingError, check_dataset_available
from alignfl.fl_app.checkpoint import CHECKPOINT, resume_checkpoint
from alignfl.fl_app.config import (
    ConfigError,
    RunConfig,
    owned_settings,
    parse_run_config,
    pyproject_problem,
    results_root,
    validate_run,
)
from alignfl.fl_app.engines.batched import ray_options, run_batched
from alignfl.fl_app.inprocess import run_in_process
from alignfl.fl_app.locations import shipped
from alignfl.fl_app.results import write_json
from alignfl.fl_app.runtime.launch import simulate_on_local_superlink
from alignfl.fl_app.runtime.processes import Stopped, stop_signals
from alignfl.fl_app.sweeps.configs import register_configs
from alignfl.fl_app.sweeps.fixed import fixed_key_problem
from alignfl.fl_app.sweeps.launches import LAUNCH_KEY, JobBusy, job_marker, launch_of_job, launch_progress, start_launch
from alignfl.fl_app.sweeps.overrides import unowned_override
from alignfl.fl_app.sweeps.resolvers import composition_problem, derivation, interpolation_problem, register_resolvers
from alignfl.fl_app.sweeps.sim import SimSettings
from alignfl.fl_app.sweeps.slurm import slurm_problem
from alignfl.fl_app.sweeps.tracking import sweep_child, sweep_store
from alignfl.plugins.options import settings_fields

log = logging.getLogger(__name__)

GROUPS = ("strategy", "model")
"""Config groups whose choice is a run-config key of the same name; their options hold that algorithm's or
model's own settings."""
register_resolvers()  # presets derive counts: the drift study's rounds = budget / E x stages
STUDY = "study"
NOT_RUN_CONFIG = ("sim", "hydra", STUDY)
"""Top-level sections that set no run-config key: the simulation's settings, Hydra's, and ``study``, values a
preset derives run-config keys from (the drift study's epoch budget)."""
RUN_NAME = "run"
JOB_RECORD = "job.json"
COMPLETED, FAILED = "completed", "failed"


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
    resolvable = [*sections, *(key for key in (STUDY,) if key in cfg)]  # run-config keys may be derived from it
    container = OmegaConf.to_container(OmegaConf.masked_copy(cfg, resolvable), resolve=True)
    assert isinstance(container, dict)
    container.pop(STUDY, None)
    keys = _known_keys()
    values: dict[str, Any] = {group: choices[group] for group in GROUPS}
    unmapped = []
    for path, value in _leaves(container).items():
        key = _run_config_key(path, keys)
        if key is None:
            unmapped.append(path)
        else:
            values[key] = value
    if unmapped:
        raise ConfigError(
            f"Hydra key(s) {sorted(unmapped)} map to no run-config key; a path is "
            "<section>.<key with _ for ->, e.g. train.lr or data.dirichlet_alpha"
        )
    return values


def _known_keys() -> set[str]:
    """Every run-config key: the common sections' and every algorithm's and model's own."""
    return set(owned_settings()) | {s.key for settings in SECTIONS.values() for s in settings_fields(settings)}


def _run_config_key(path: str, keys: set[str]) -> str | None:
    """The run-config key a Hydra path sets (``train.lr`` → ``lr``) among ``keys``, or None."""
    section, _, leaf = path.rpartition(".")
    return key_of_path("" if section in GROUPS else section, leaf, keys)


def _derived_note(cfg: DictConfig, message: str) -> str:
    """For a refused run-config key whose value ``cfg`` derives (a preset's ``${div:...}``): how, and the values
    it reads, so that the message names the key that was set; else empty."""
    named = set(re.findall(r"run-config key '([\w-]+)'", message))
    sections = [key for key in cfg if key not in NOT_RUN_CONFIG]
    written = OmegaConf.to_container(OmegaConf.masked_copy(cfg, sections), resolve=False)
    keys = _known_keys()
    notes = [
        derivation(cfg, path, value)
        for path, value in _leaves(written).items()  # type: ignore[arg-type]
        if isinstance(value, str) and "${" in value and _run_config_key(path, keys) in named
    ]
    return f"; {'; '.join(notes)}" if notes else ""


def job_settings(cfg: DictConfig, choices: Mapping[str, Any], results_dir: Path) -> tuple[RunConfig, SimSettings]:
    """The validated run config (its run folder in ``results_dir``) and simulation settings of one job; a value a
    preset derives that cannot be resolved, or that the schema refuses, is a :class:`ConfigError` naming the keys
    it was derived from."""
    try:
        sim = SimSettings.from_config(OmegaConf.to_container(cfg.sim, resolve=True))  # type: ignore[arg-type]
        mapped = hydra_to_run_config(cfg, choices)
    except OmegaConfBaseException as error:
        raise ConfigError(interpolation_problem(cfg, error)) from None
    values = {
        **mapped,
        "min-available-nodes": sim.num_supernodes,
        "results-dir": str(results_dir.resolve()),
        "run-name": RUN_NAME,
    }
    try:
        config = parse_run_config(values)
        validate_run(config, sim.num_supernodes)
    except ConfigError as error:
        raise ConfigError(f"{error}{_derived_note(cfg, str(error))}") from None
    return config, sim


def task_overrides(hydra_config: DictConfig) -> list[str]:
    """A job's (or the command's) overrides as typed, not resolved: each is Hydra's text."""
    return [str(override) for override in OmegaConf.to_container(hydra_config.overrides.task, resolve=False)]


def sweep_job_overrides(config: DictConfig) -> list[list[str]]:
    """Every job's overrides, expanded as Hydra's basic sweeper expands them (its params, then the command line),
    as they were typed: a value such as ``${...}`` is the job's to resolve."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    typed = OmegaConf.to_container(params, resolve=False) if OmegaConf.is_config(params) else params
    arguments = [f"{key}={value}" for key, value in typed.items()] + task_overrides(config.hydra)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(arguments), None) for job in batch]


SEED_OVERRIDE = re.compile(r"seed=-?\d+")
"""A job's plain seed override: it chooses no config file, so jobs that differ in it alone compose alike."""


def composed_jobs(config: DictConfig, jobs: list[list[str]]) -> Iterator[tuple[list[str], DictConfig]]:
    """Each job's overrides and composed config, as Hydra composes it for the job. A job that differs from an
    earlier one only in a plain ``seed=N`` is that job's composition with the seed set: Hydra spends a tenth of a
    second or more per job composing, most of a many-seed sweep's check (the drift study: 312 jobs)."""
    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    by_others: dict[tuple[str, ...], DictConfig] = {}
    for overrides in jobs:
        seeds = [override for override in overrides if SEED_OVERRIDE.fullmatch(override)]
        others = tuple(override for override in overrides if override not in seeds)
        if len(seeds) == 1 and others in by_others:
            job_cfg = copy.deepcopy(by_others[others])
            job_cfg.seed = parser.parse_override(seeds[0]).value()
        else:
            try:
                job_cfg = loader.load_sweep_config(config, overrides)
            except HydraException as error:  # an unknown option of a swept config group, among others
                raise _job_error(overrides, composition_problem(error)) from None
            if len(seeds) == 1:
                by_others[others] = job_cfg
        yield overrides, job_cfg


def _job_error(overrides: list[str], problem: str) -> ConfigError:
    """The schema's error for one job of a multirun, prefixed with its overrides."""
    return ConfigError(f"sweep job {' '.join(overrides) or '(no overrides)'}: {problem}")


def validate_sweep(config: DictConfig) -> list[list[str]]:
    """Compose and validate every job of a multirun, then check each dataset it needs is on disk.

    Raises the schema's :class:`ConfigError` (prefixed with the job's overrides) at the first bad job;
    returns every job's overrides.
    """
    if (problem := fixed_key_problem(config)) is not None:
        raise ConfigError(problem)
    sweep_dir = Path(config.hydra.sweep.dir)
    jobs = sweep_job_overrides(config)
    datasets, clusters = set(), {}
    for overrides, job_cfg in composed_jobs(config, jobs):
        try:
            run_config, sim = job_settings(job_cfg, job_cfg.hydra.runtime.choices, sweep_dir)
            if run_config.resume_from:
                resume_checkpoint(run_config)  # a missing, unreadable or mismatched checkpoint
        except ConfigError as error:
            raise _job_error(overrides, str(error)) from None
        datasets.add((run_config.dataset, run_config.data_root or None))
        if sim.ray_address is not None:
            clusters.setdefault((sim.ray_address, sim.client_cpus, sim.client_gpus), sim)
    for name, root in sorted(datasets, key=str):
        check_dataset_available(name, root)
    for sim in clusters.values():
        sim.attach()
    return jobs


def refuse(message: str) -> NoReturn:
    """End the command before anything starts: the message, exit code 2, no traceback."""
    print(f"[alignfl] refused before starting: {message}", file=sys.stderr)
    raise SystemExit(2)  # Hydra turns a callback's exception into a warning and carries on; exiting stops it


class ValidateSweep(Callback):
    """Refuse a run, before Hydra makes its folder, or a multirun, before any job trains, when a job has a config
    the schema rejects, a data set that is not on disk, a checkpoint to resume that cannot be read or does not
    fit, a Ray cluster that does not answer, or (``hydra/launcher=slurm``) no SLURM to submit to: what the
    launcher and the deployment check before they start."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            if (problem := fixed_key_problem(config)) is not None:
                raise ConfigError(problem)
            run_config, sim = job_settings(config, config.hydra.runtime.choices, Path(config.hydra.run.dir))
            check_dataset_available(run_config.dataset, run_config.data_root or None)
            if run_config.resume_from:
                resume_checkpoint(run_config)
            sim.attach()
        except (ConfigError, DatasetMissingError) as error:
            refuse(str(error))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = OmegaConf.select(config, "hydra.launcher._target_") or ""
        problem = slurm_problem() if launcher.endswith("SlurmLauncher") else None
        if problem is not None:
            refuse(problem)
        target = OmegaConf.select(config, "hydra.sweeper._target_") or ""
        if not target.endswith(".BasicSweeper"):
            log.warning("sweeper %s: each job's config is validated when the job starts", target)
            return
        try:
            jobs = validate_sweep(config)
        except (ConfigError, DatasetMissingError) as error:
            refuse(f"invalid sweep, no job was started: {error}")
        except Exception as error:  # a sweep that cannot be checked is not started either
            log.error("validating the sweep failed:\n%s", traceback.format_exc())
            raise SystemExit(
                f"could not validate the sweep, no job was started: {type(error).__name__}: {error}"
            ) from None
        log.info("all %d jobs of the sweep passed the run-config schema", len(jobs))
        start_launch(Path(config.hydra.sweep.dir), jobs)


def simulate(config: RunConfig, sim: SimSettings) -> None:
    """Run one simulation. ``sim.backend=ray``: Flower's simulation runtime through ``flwr run`` on a private
    local SuperLink, as the launcher runs it (what Flower 1.42 recommends in place of its deprecated
    ``run_simulation``). ``sim.backend=inprocess`` calls the same ServerApp and ClientApp in this process, one
    client after the other: no Ray to start and data loaded once for every job of the sweep, the same metrics;
    ``batched`` (the default: the same metrics, no Ray to start) hands a round's messages to long-lived workers
    at once (:mod:`alignfl.fl_app.engines`)."""
    if sim.torch_threads is not None:
        torch.set_num_threads(sim.torch_threads)
    values = config.to_run_config()
    if sim.backend == "inprocess":
        run_in_process(values, sim.num_supernodes)
        return
    if sim.backend == "batched":
        workers = ray_options(
            sim.workers, sim.ray_address, sim.client_cpus, sim.client_gpus, sim.ray_cpus, sim.ray_gpus
        )
        run_batched(values, sim.num_supernodes, sim.vectorise, workers)
        return
    status, details = simulate_on_local_superlink(values, sim.federation_config(), sim.ray_address)
    if status != "finished:completed":
        raise RuntimeError(f"the simulation ended {status}: {details}")


def run_job(
    cfg: DictConfig,
    choices: Mapping[str, Any],
    job_dir: Path,
    sweep_dir: Path | None = None,
    launch: str | None = None,
) -> dict[str, Any]:
    """Validate, simulate and record one job, holding its folder's running marker meanwhile; an error is logged and
    recorded, never raised. ``sweep_dir``: the multirun's folder, whose MLflow parent run the job's run joins
    (:func:`alignfl.fl_app.sweeps.tracking.sweep_child`); ``launch``: the launch of the sweep that runs it
    (:mod:`alignfl.fl_app.sweeps.launches`), written into its record. A folder another live process is running is left
    to it: the job is failed here and its record is that process's to write."""
    try:
        with job_marker(job_dir):
            return _run_marked_job(cfg, choices, job_dir, sweep_dir, launch)
    except JobBusy as busy:
        log.error("job not run: %s", busy)
        return {"status": FAILED, "error": f"{type(busy).__name__}: {busy}", "run-folder": None, LAUNCH_KEY: launch}


def _run_marked_job(
    cfg: DictConfig, choices: Mapping[str, Any], job_dir: Path, sweep_dir: Path | None, launch: str | None
) -> dict[str, Any]:
    """:func:`run_job`'s work, once the job's folder is its own."""
    started = time.time()
    record: dict[str, Any] = {
        "status": FAILED,
        "error": None,
        "run-folder": None,
        "slurm-job-id": os.environ.get("SLURM_JOB_ID"),
    }  # where SLURM ran it
    try:
        with stop_signals():  # SIGTERM, SIGHUP and Ctrl-C unwind the job: every process it started is stopped
            config, sim = job_settings(cfg, choices, job_dir)
            config = sweep_store(config, sweep_dir)
            run_folder = Path(config.resume_from) if config.resume_from else results_root(config) / config.run_name
            finished = _finished_record(job_dir, run_folder)
            if finished is not None:  # a sweep run again in its folder keeps what it finished
                log.info("job in %s completed earlier: kept", job_dir)
                record = dict(finished)
            else:
                sim = sim.attach()  # the jobs of a sweep join the cluster one after another
                if not config.resume_from and (run_folder / CHECKPOINT).is_file():  # interrupted: go on from there
                    config = config.replace(resume_from=str(run_folder))
                with sweep_child(config, sweep_dir, job_dir):
                    simulate(config, sim)
        if not (run_folder / "summary.json").is_file():
            raise RuntimeError(f"the simulation ended without writing {run_folder / 'summary.json'}")
        record.update(status=COMPLETED, **{"run-folder": str(run_folder)})
    except Exception as error:  # a failed job is reported and the sweep goes on
        log.error("job in %s failed:\n%s", job_dir, traceback.format_exc())
        record["error"] = f"{type(error).__name__}: {error}"
    except Stopped as stop:  # recorded, then the sweep stops (main)
        record["error"] = f"stopped by {stop}"
        raise
    finally:
        record.setdefault("job-wall-time-s", time.time() - started)  # a kept job keeps its own
        record[LAUNCH_KEY] = launch
        write_json(job_dir / JOB_RECORD, record)
    return record


def _finished_record(job_dir: Path, run_folder: Path) -> dict[str, Any] | None:
    """The record of a job that completed in an earlier launch of the same sweep (its run's summary written),
    else None."""
    try:
        record = json.loads((job_dir / JOB_RECORD).read_text())
    except (OSError, ValueError):
        return None
    completed = isinstance(record, dict) and record.get("status") == COMPLETED
    return record if completed and (run_folder / "summary.json").is_file() else None


class JobFailed(RuntimeError):
    """A single (non-multirun) job failed: the command exits non-zero."""


@hydra.main(version_base="1.3", config_path=str(shipped("conf")), config_name="config")
def hydra_main(cfg: DictConfig) -> str:
    """One Hydra job; returns its status (a multirun's report is written by ``alignfl.fl_app.sweeps.report``)."""
    hydra_config = HydraConfig.get()
    multirun = hydra_config.mode == RunMode.MULTIRUN
    sweep_dir = Path(hydra_config.sweep.dir) if multirun else None
    launch = launch_of_job(sweep_dir, task_overrides(hydra_config)) if sweep_dir is not None else None
    record = run_job(cfg, hydra_config.runtime.choices, Path(hydra_config.runtime.output_dir), sweep_dir, launch)
    if sweep_dir is not None:
        print(f"[alignfl] {launch_progress(sweep_dir, launch, JOB_RECORD, COMPLETED)}", flush=True)
    if record["status"] == FAILED and not multirun:
        raise JobFailed(record["error"])
    return record["status"]


def main() -> None:
    """``python -m alignfl.fl_app.sweep``: refuse an override no chosen algorithm or model has, or a stale
    ``pyproject.toml`` run-config table (as the launcher does), then run Hydra; a stop signal ends it with
    128 + its number once the job has stopped what it started. The signal also stops a parallel launcher's
    workers: raised while joblib waits for them, it makes joblib kill each worker with the processes it started
    (without this block the launcher process died alone and its workers trained on)."""
    register_configs()
    problem = unowned_override(sys.argv[1:]) or pyproject_problem()
    if problem is not None:
        refuse(problem)
    try:
        with stop_signals():  # a job run in this process stops its own processes first (its inner block)
            hydra_main()
    except Stopped as stop:
        print(f"[alignfl] stopped by {stop}: every process the job started has been stopped", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None


if __name__ == "__main__":
    main()
