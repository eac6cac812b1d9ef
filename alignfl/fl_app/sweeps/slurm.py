"""Sweeps on SLURM: Hydra's submitit launcher, waiting for every job and recording how each one ended.

``python -m alignfl.fl_app.sweep -m hydra/launcher=slurm ...`` (``conf/hydra/launcher/slurm.yaml``) submits each job of
a multirun as a task of one SLURM job array. Hydra's own submitit launcher returns at the first job that did not
end well (a cancelled, timed-out or killed job raises) while the others may still run, and it learns a job's end
from ``sacct``, which a cluster without accounting does not answer. :class:`SlurmLauncher` therefore waits until
every job has ended, each one's state read from SLURM (``scontrol``, else ``sacct``), and writes
:data:`JOBS_RECORD` into the sweep folder: per job its overrides, SLURM job id, end state and log files. The
sweep report (:mod:`alignfl.fl_app.sweeps.report`) reads it to list each failed job with its SLURM id, state and log
while the others' results count, also for a job that SLURM ended before it started.

On the compute node each job runs on the engine its config chooses (``sim.backend``; the sweeps' default, the
batched engine, needs no Ray on a node SLURM gave a few cores unless ``sim.workers`` asks for Ray actors);
``sim_backend`` overrides it for every job whose command line does not set ``sim.backend`` (:func:`set_backend`).
The resources each job asks for come from the ``sim.*`` keys (:func:`job_cpus`, :func:`job_gpus`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

log = logging.getLogger(__name__)

JOBS_RECORD = "slurm-jobs.json"
"""Written into the sweep folder once every job has ended: one entry per job (:class:`SlurmJob`)."""
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)
"""SLURM's job states after which a job runs no more."""
POLL_S = 2.0
PING_TIMEOUT_S = 20.0
"""Seconds the SLURM controller has to answer ``scontrol ping`` before a sweep is refused."""


def slurm_problem(timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """Why a sweep cannot submit its jobs to SLURM from this machine, or None: ``sbatch`` must be on the PATH
    and the controller must answer ``scontrol ping``, or submitit would fail with its own traceback after the
    sweep folder was made."""
    if shutil.which("sbatch") is None:
        return (
            "hydra/launcher=slurm needs SLURM's sbatch, which is not on this machine's PATH: run the sweep on a "
            "node that submits SLURM jobs, or leave hydra/launcher=slurm out to run the jobs here"
        )
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return "hydra/launcher=slurm: sbatch is here but scontrol is not, so the SLURM controller cannot be asked"
    except subprocess.TimeoutExpired:
        return f"hydra/launcher=slurm: the SLURM controller did not answer `scontrol ping` within {timeout_s:.0f} s"
    answer = " ".join((ping.stdout + ping.stderr).split())
    if ping.returncode != 0 or " is UP" not in answer:
        return (
            f"hydra/launcher=slurm: the SLURM controller does not answer (`scontrol ping`: {answer or 'no output'}), "
            "so sbatch could not submit the jobs"
        )
    return None


def job_cpus(torch_threads: int | None, ray_cpus: int | None, client_cpus: float) -> int:
    """CPUs per SLURM task: the job's torch threads, or its own Ray's CPUs (at least one client's)."""
    return max(torch_threads or 1, ray_cpus or math.ceil(client_cpus))


def job_gpus(client_gpus: float, ray_gpus: float | None) -> int | None:
    """GPUs per node: the job's own Ray's, or what one client asks for, rounded up; None for none (a cluster
    without GPUs refuses even ``--gpus-per-node=0``)."""
    gpus = math.ceil(ray_gpus if ray_gpus is not None else client_gpus)
    return gpus or None


def register_launcher() -> None:
    """The launcher config ``conf/hydra/launcher/slurm.yaml`` builds on, and the resolvers it maps the ``sim.*``
    keys with."""
    ConfigStore.instance().store(
        group="hydra/launcher", name="alignfl_slurm", node=AlignflSlurmConf, provider="alignfl"
    )
    for name, function in (("alignfl_slurm_cpus", job_cpus), ("alignfl_slurm_gpus", job_gpus)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


@dataclass
class AlignflSlurmConf(SlurmQueueConf):
    """Hydra's ``submitit_slurm`` launcher config, run by :class:`SlurmLauncher`, plus the backend jobs use."""

    _target_: str = "hydra_plugins.alignfl_slurm.SlurmLauncher"
    sim_backend: str | None = None
    """``sim.backend`` of every job whose command line does not set it; None (the default): the config's."""


@dataclass(frozen=True)
class SlurmJob:
    """How one job of the sweep ended on SLURM."""

    job_num: int
    overrides: list[str]
    slurm_job_id: str
    state: str
    stdout: str
    stderr: str


def slurm_state(job_id: str, stdout: Path) -> str:
    """SLURM's state of a job (``COMPLETED``, ``CANCELLED``, ``RUNNING``, ...): from ``scontrol``, which knows a
    job until ``MinJobAge`` after its end, else ``squeue`` (a pending array task has no record of its own),
    else ``sacct`` (accounting). A job none of them lists, that never wrote its log ``stdout``, was taken off the
    queue before it started: ``CANCELLED`` (scancel leaves no other trace of a pending array task). ``UNKNOWN``
    otherwise."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False)
    for item in shown.stdout.split():
        if item.startswith("JobState="):
            return item.split("=", 1)[1]
    queued = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%T", "-j", job_id], capture_output=True, text=True, check=False
    )
    if queued.stdout.strip():
        return queued.stdout.split()[0]
    if shutil.which("sacct"):
        listed = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-o", "State", "-j", job_id], capture_output=True, text=True, check=False
        )
        states = listed.stdout.split()
        if listed.returncode == 0 and states:
            return states[0]  # "CANCELLED by 0" names who: its first word is the state
    return "UNKNOWN" if stdout.exists() else "CANCELLED"


def set_backend(config: DictConfig, sweep_overrides: Sequence[str], sim_backend: str | None) -> None:
    """``sim.backend`` = ``sim_backend`` where one is given and the job's overrides do not set it: a config file's
    choice (``sim.backend: ray``) stands unless the launcher is told otherwise."""
    if sim_backend is not None and not any(o.lstrip("+~").startswith("sim.backend=") for o in sweep_overrides):
        config.sim.backend = sim_backend


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """Hydra's submitit SLURM launcher, waiting for every job and recording each one's end (see the module)."""

    def __init__(self, sim_backend: str | None = None, **params: Any) -> None:
        super().__init__(**params)
        self.sim_backend = sim_backend

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str, singleton_state: dict
    ) -> JobReturn:
        """On the compute node: Hydra's job, with ``sim.backend`` set to :attr:`sim_backend` unless the job sets
        it (in its config, not its overrides: its folder and its row in the report stay those of a local run)."""
        import submitit

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        submitit_launcher.Singleton.set_state(singleton_state)
        setup_globals()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        with open_dict(config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            job.num = job_num
        set_backend(config, sweep_overrides, self.sim_backend)
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit the jobs as one array, wait until every one has ended, record them; a job SLURM ended badly
        is returned as done with the value ``failed`` (the sweeper would stop at its error before the report)."""
        import submitit

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=self.params["submitit_folder"],
            slurm_max_num_timeout=self.params.get("max_num_timeout", 0),
        )
        base = set(OmegaConf.structured(submitit_launcher.BaseQueueConf).keys())
        executor.update_parameters(
            **{
                key if key in base else f"{self._EXECUTOR}_{key}": value
                for key, value in self.params.items()
                if key not in ("submitit_folder", "max_num_timeout")
            }
        )
        arguments = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", number, " ".join(filter_overrides(overrides)))
            arguments.append(
                (
                    list(overrides),
                    "hydra.sweep.dir",
                    number,
                    f"job_id_for_{number}",
                    submitit_launcher.Singleton.get_state(),
                )
            )
        jobs = executor.map_array(self, *zip(*arguments))
        log.info(
            "submitted SLURM job array %s (%d jobs); waiting for every job to end",
            jobs[0].job_id.split("_")[0] if jobs else "-",
            len(jobs),
        )
        states = wait_for_jobs(jobs)
        records = [
            SlurmJob(
                number, list(overrides), job.job_id, states[job.job_id], str(job.paths.stdout), str(job.paths.stderr)
            )
            for (overrides, _, number, _, _), job in zip(arguments, jobs)
        ]
        write_jobs_record(sweep_dir, records)
        return [self._job_return(job, record) for job, record in zip(jobs, records)]

    @staticmethod
    def _job_return(job: Any, record: SlurmJob) -> JobReturn:
        if record.state == "COMPLETED" and job.paths.result_pickle.exists():
            try:
                return job.results()[0]
            except Exception as error:  # the job's Python raised: its log says why
                log.error("SLURM job %s: %s", record.slurm_job_id, error)
        log.error(
            "SLURM job %s (%s) ended %s; its log: %s",
            record.slurm_job_id,
            " ".join(record.overrides),
            record.state,
            record.stderr,
        )
        returned = JobReturn(overrides=record.overrides, status=JobStatus.COMPLETED)
        returned.return_value = "failed"
        return returned


def wait_for_jobs(jobs: Sequence[Any], poll_s: float = POLL_S) -> dict[str, str]:
    """Wait until every submitit job has ended (SLURM says it ended, or no longer lists it); returns job id →
    state (``COMPLETED`` for one SLURM no longer lists whose result was written)."""
    states: dict[str, str] = {}
    while len(states) < len(jobs):
        for job in jobs:
            if job.job_id in states:
                continue
            state = slurm_state(job.job_id, job.paths.stdout)
            if state == "UNKNOWN":
                states[job.job_id] = "COMPLETED" if job.paths.result_pickle.exists() else state
            elif state.split()[0] in ENDED:
                states[job.job_id] = state
        if len(states) < len(jobs):
            time.sleep(poll_s)
    return states


def write_jobs_record(sweep_dir: Path, jobs: list[SlurmJob]) -> None:
    """Add these jobs to the sweep folder's :data:`JOBS_RECORD` (a job run again replaces its entry)."""
    path = sweep_dir / JOBS_RECORD
    kept = {entry["job_num"]: entry for entry in (json.loads(path.read_text()) if path.exists() else [])}
    kept.update({job.job_num: asdict(job) for job in jobs})
    path.write_text(json.dumps([kept[number] for number in sorted(kept)], indent=2) + "\n")


def read_jobs_record(sweep_dir: Path) -> list[SlurmJob]:
    """The sweep's SLURM jobs as :class:`SlurmLauncher` recorded them (none for a sweep that ran elsewhere)."""
    path = sweep_dir / JOBS_RECORD
    return [SlurmJob(**entry) for entry in json.loads(path.read_text())] if path.exists() else []
