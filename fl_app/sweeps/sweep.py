"""Hydra entry point: one in-process Flower simulation per Hydra job.

    python -m fl_app.sweep pan.mode=mul pan.t=4 pan.a=0.1 data.dirichlet_alpha=0.1 seed=1
    python -m fl_app.sweep -m pan.mode=mul pan.t=1,4,8 pan.a=0,0.05,0.1 data.dirichlet_alpha=0.1,1.0 seed=0,1,2

The Hydra configs are generated from the settings classes (:func:`register_configs`: the
common sections of :mod:`core.config`, every registered algorithm under ``strategy/`` and
every model under ``model/``), so their defaults are the schema's. Paths map onto run-config
keys mechanically (:func:`core.config.key_of_path`: ``data.root`` is ``data-root``,
``strategy.fedprox_mu`` is ``fedprox-mu``), and the result is validated by
:func:`fl_app.config.parse_run_config`, the schema ``flwr run`` uses. An override of a key
that only an unselected algorithm or model has is refused before Hydra starts, naming its
owner. A single run is checked before Hydra makes its folder, and a multirun checks every
job's config before the first job trains (:class:`ValidateSweep`; both exit with code 2).
Each job writes its run folder ``<job dir>/run`` and a ``job.json`` (status, error, wall
time) that :mod:`fl_app.sweeps.report` reads; a job that fails is logged and recorded, and
the sweep goes on.
"""

from __future__ import annotations

import copy
import json
import logging
import math
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
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from core.config import PARTITIONER_SECTION, SECTIONS, hydra_leaf, key_of_path
from core.data import DatasetMissingError, check_dataset_available
from core.partitioning.partitioners import PARTITIONERS, list_partitioners
from fl_app.checkpoint import CHECKPOINT, resume_checkpoint
from fl_app.config import (
    ConfigError,
    RunConfig,
    owned_settings,
    parse_run_config,
    pyproject_problem,
    renamed_keys,
    results_root,
    validate_run,
)
from fl_app.engines.batched import ray_options, run_batched
from fl_app.inprocess import run_in_process
from fl_app.progress import start_sweep, sweep_progress
from fl_app.results import write_json
from fl_app.runtime.common import PROJECT_ROOT
from fl_app.runtime.launch import simulate_on_local_superlink
from fl_app.runtime.processes import Stopped, stop_signals
from fl_app.sweeps.sim import SimSettings
from fl_app.sweeps.slurm import register_launcher, slurm_problem
from fl_app.sweeps.tracking import sweep_child, sweep_store
from models import list_models
from models.registry import model_options
from plugins.options import settings_fields
from strategies import get_strategy, list_strategies

log = logging.getLogger(__name__)

GROUPS = ("strategy", "model")
"""Config groups whose choice is a run-config key of the same name; their options hold that algorithm's or
model's own settings."""
#: Run-config keys each job sets itself: every node must join, and the run folder goes in the job's folder.
SET_PER_JOB = ("min-available-nodes", "results-dir", "run-name")
if not OmegaConf.has_resolver("mul"):  # presets derive counts: the drift study's rounds = budget / E x stages
    OmegaConf.register_new_resolver("mul", lambda *factors: math.prod(int(f) for f in factors))
if not OmegaConf.has_resolver("div"):
    OmegaConf.register_new_resolver("div", lambda total, part: int(total) // int(part))
STUDY = "study"
NOT_RUN_CONFIG = ("sim", "hydra", STUDY)
"""Top-level sections that set no run-config key: the simulation's settings, Hydra's, and ``study``, values a
preset derives run-config keys from (the drift study's epoch budget)."""
RUN_NAME = "run"
JOB_RECORD = "job.json"
COMPLETED, FAILED = "completed", "failed"


def _section_node(section: str, settings: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Hydra node of a settings class: leaf → default."""
    return {hydra_leaf(section, s.key): s.default for s in settings_fields(settings) if s.key not in skip}


def register_configs() -> None:
    """Put the generated configs into Hydra's ConfigStore (again after an algorithm or model registers)."""
    store = ConfigStore.instance()
    store.store(name="alignfl_run", node=_section_node("", SECTIONS[""], ("strategy", "model", *SET_PER_JOB)))
    partitioners = {}
    for name in list_partitioners():
        partitioners.update(_section_node(PARTITIONER_SECTION, PARTITIONERS.get(name).settings))
    for section, settings in SECTIONS.items():
        if section:
            node = _section_node(section, settings, SET_PER_JOB)
            store.store(
                group=section, name="default", node={**node, **partitioners} if section == PARTITIONER_SECTION else node
            )
    register_launcher()
    store.store(
        group="sim", name="default", node={f: spec.default for f, spec in SimSettings.__dataclass_fields__.items()}
    )
    for name in list_strategies():
        store.store(group="strategy", name=name, node=_section_node("", get_strategy(name).settings))
    for name in list_models():
        store.store(group="model", name=name, node=_section_node("", model_options(name)))


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
    keys = set(owned_settings()) | {s.key for settings in SECTIONS.values() for s in settings_fields(settings)}
    values: dict[str, Any] = {group: choices[group] for group in GROUPS}
    unmapped = []
    for path, value in _leaves(container).items():
        section, _, leaf = path.rpartition(".")
        key = key_of_path("" if section in GROUPS else section, leaf, keys)
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


def job_settings(cfg: DictConfig, choices: Mapping[str, Any], results_dir: Path) -> tuple[RunConfig, SimSettings]:
    """The validated run config (its run folder in ``results_dir``) and simulation settings of one job."""
    sim = SimSettings.from_config(OmegaConf.to_container(cfg.sim, resolve=True))  # type: ignore[arg-type]
    values = {
        **hydra_to_run_config(cfg, choices),
        "min-available-nodes": sim.num_supernodes,
        "results-dir": str(results_dir.resolve()),
        "run-name": RUN_NAME,
    }
    config = parse_run_config(values)
    validate_run(config, sim.num_supernodes)
    return config, sim


def sweep_job_overrides(config: DictConfig) -> list[list[str]]:
    """Every job's overrides, expanded as Hydra's basic sweeper expands them (its params, then the command line)."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
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
            job_cfg = loader.load_sweep_config(config, overrides)
            if len(seeds) == 1:
                by_others[others] = job_cfg
        yield overrides, job_cfg


def validate_sweep(config: DictConfig) -> int:
    """Compose and validate every job of a multirun, then check each dataset it needs is on disk.

    Raises the schema's :class:`ConfigError` (prefixed with the job's overrides) at the first bad job;
    returns the number of jobs.
    """
    sweep_dir = Path(config.hydra.sweep.dir)
    jobs = sweep_job_overrides(config)
    datasets, clusters = set(), {}
    for overrides, job_cfg in composed_jobs(config, jobs):
        try:
            run_config, sim = job_settings(job_cfg, job_cfg.hydra.runtime.choices, sweep_dir)
            if run_config.resume_from:
                resume_checkpoint(run_config)  # a missing, unreadable or mismatched checkpoint
        except ConfigError as error:
            raise ConfigError(f"sweep job {' '.join(overrides) or '(no overrides)'}: {error}") from None
        datasets.add((run_config.dataset, run_config.data_root or None))
        if sim.ray_address is not None:
            clusters.setdefault((sim.ray_address, sim.client_cpus, sim.client_gpus), sim)
    for name, root in sorted(datasets, key=str):
        check_dataset_available(name, root)
    for sim in clusters.values():
        sim.attach()
    return len(jobs)


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
            count = validate_sweep(config)
        except (ConfigError, DatasetMissingError) as error:
            refuse(f"invalid sweep, no job was started: {error}")
        except Exception as error:  # a sweep that cannot be checked is not started either
            log.error("validating the sweep failed:\n%s", traceback.format_exc())
            raise SystemExit(
                f"could not validate the sweep, no job was started: {type(error).__name__}: {error}"
            ) from None
        log.info("all %d jobs of the sweep passed the run-config schema", count)
        start_sweep(Path(config.hydra.sweep.dir), count)


def simulate(config: RunConfig, sim: SimSettings) -> None:
    """Run one simulation. ``sim.backend=ray``: Flower's simulation runtime through ``flwr run`` on a private
    local SuperLink, as the launcher runs it (what Flower 1.42 recommends in place of its deprecated
    ``run_simulation``). ``sim.backend=inprocess`` calls the same ServerApp and ClientApp in this process, one
    client after the other: no Ray to start and data loaded once for every job of the sweep, the same metrics;
    ``batched`` (the default: the same metrics, no Ray to start) hands a round's messages to long-lived workers
    at once (:mod:`fl_app.engines`)."""
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
    cfg: DictConfig, choices: Mapping[str, Any], job_dir: Path, sweep_dir: Path | None = None
) -> dict[str, Any]:
    """Validate, simulate and record one job; an error is logged and recorded, never raised. ``sweep_dir``: the
    multirun's folder, whose MLflow parent run the job's run joins (:func:`fl_app.sweeps.tracking.sweep_child`)."""
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
        job_dir.mkdir(parents=True, exist_ok=True)
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


@hydra.main(version_base="1.3", config_path=str(PROJECT_ROOT / "conf"), config_name="config")
def hydra_main(cfg: DictConfig) -> str:
    """One Hydra job; returns its status (a multirun's report is written by ``fl_app.sweeps.report``)."""
    hydra_config = HydraConfig.get()
    multirun = hydra_config.mode == RunMode.MULTIRUN
    sweep_dir = Path(hydra_config.sweep.dir) if multirun else None
    record = run_job(cfg, hydra_config.runtime.choices, Path(hydra_config.runtime.output_dir), sweep_dir)
    if sweep_dir is not None:
        print(f"[alignfl] {sweep_progress(sweep_dir, JOB_RECORD, COMPLETED)}", flush=True)
    if record["status"] == FAILED and not multirun:
        raise JobFailed(record["error"])
    return record["status"]


_OVERRIDE = re.compile(r"^(?P<group>strategy|model)(?:\.(?P<leaf>\w+))?=(?P<value>.*)$")


def preset_choices(arguments: list[str]) -> dict[str, list[str]] | None:
    """The algorithm and model the command's config picks before its own ``strategy=``/``model=`` choices: the
    defaults, or what an experiment preset (``+experiment=NAME``, or one of its rows) chooses. Composed without the
    command's swept values and its ``strategy.*``/``model.*``/``hydra.*`` overrides: the check is of those. None
    where that does not compose (an unknown preset): Hydra's own run then says what is wrong."""
    if not any(argument.lstrip("+~").startswith("experiment") for argument in arguments):
        return {"strategy": ["fedavg"], "model": ["mlp"]}  # conf/config.yaml's defaults: nothing to compose
    kept = [a for a in arguments if not _OVERRIDE.match(a.lstrip("+~")) and not a.startswith("hydra.") and "," not in a]
    register_configs()
    try:
        with hydra.initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            choices = hydra.compose("config", overrides=kept, return_hydra_config=True).hydra.runtime.choices
    except Exception:  # Hydra's errors have no common base class
        return None
    return {group: [choices[group]] for group in ("strategy", "model")}


def unowned_override(arguments: list[str]) -> str | None:
    """Why an override sets a key that the chosen algorithm or model (every choice of a swept group) lacks, or
    None; Hydra itself would only say that the key is not in the config."""
    given: dict[str, list[str]] = {}
    leaves: list[tuple[str, str]] = []
    for argument in arguments:
        match = _OVERRIDE.match(argument.lstrip("+~"))
        if match is None:
            continue
        if match["leaf"] is None:
            given[match["group"]] = match["value"].split(",")
        else:
            leaves.append((match["group"], match["leaf"]))
    if all(group in given for group, _ in leaves):  # no leaf at all, or every leaf's group chosen here
        choices = given
    else:
        preset = preset_choices(arguments)
        if preset is None:
            return None
        choices = {**preset, **given}
    owned, renamed = owned_settings(), renamed_keys()
    for group, leaf in leaves:
        key = leaf.replace("_", "-")
        owners = list(owned[key].owners) if key in owned else []
        strays = [choice for choice in choices[group] if choice not in owners]
        if not owners and key in renamed:
            now = ", ".join(f"{group}.{new.replace('-', '_')} ({group}={name})" for name, new in renamed[key].items())
            return f"override {group}.{leaf}: '{key}' was renamed; write {now}"
        if not owners:
            return f"override {group}.{leaf}: no {group} has a setting '{key}'"
        if strays:
            return (
                f"override {group}.{leaf}: '{key}' belongs to {group} {owners}, not to {group} {strays}; "
                f"set {group}={owners[0]} or leave the override out"
            )
    return None


def main() -> None:
    """``python -m fl_app.sweep``: refuse an override no chosen algorithm or model has, or a stale
    ``pyproject.toml`` run-config table (as the launcher does), then run Hydra; a stop signal ends it with
    128 + its number once the job has stopped what it started."""
    register_configs()
    problem = unowned_override(sys.argv[1:]) or pyproject_problem()
    if problem is not None:
        refuse(problem)
    try:
        hydra_main()
    except Stopped as stop:
        print(f"[alignfl] stopped by {stop}: every process the job started has been stopped", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None


if __name__ == "__main__":
    main()
