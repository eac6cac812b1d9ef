"""Sweeps on SLURM: the launcher config, the resources it asks for, and the report of jobs SLURM ended.

A real SLURM cluster is exercised by ``scripts/slurm_check.sh`` (root, not part of CI).
"""

from __future__ import annotations

import csv

from alignfl.fl_app.sweeps import report as sweep_report
from alignfl.fl_app.sweeps.slurm import SlurmJob, job_cpus, job_gpus, read_jobs_record, set_backend, write_jobs_record
from tests.sweep_jobs import composed, fake_job


def test_the_slurm_launcher_asks_for_what_the_sim_keys_need():
    cfg = composed(
        [
            "hydra/launcher=slurm",
            "sim.client_gpus=0.25",
            "sim.torch_threads=3",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.account=lab",
        ]
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.alignfl_slurm.SlurmLauncher"
    assert (launcher.cpus_per_task, launcher.gpus_per_node, launcher.partition, launcher.account) == (
        3,
        1,
        "gpu",
        "lab",
    )
    assert launcher.sim_backend is None and launcher.timeout_min == 240  # each job on its config's engine
    assert composed(["hydra/launcher=slurm"]).hydra.launcher.gpus_per_node is None  # no GPU: no --gpus-per-node


def test_a_config_files_engine_stands_on_slurm_unless_the_launcher_is_told_otherwise():
    """``sim.backend: ray`` in a config file is the job's engine; ``hydra.launcher.sim_backend=batched`` overrides
    it, but not a job's own ``sim.backend=`` on the command line."""
    cfg = composed(["hydra/launcher=slurm", "sim.backend=ray"])  # as a config file would set it
    set_backend(cfg, [], cfg.hydra.launcher.sim_backend)
    assert cfg.sim.backend == "ray"
    set_backend(cfg, [], "batched")
    assert cfg.sim.backend == "batched"
    cfg.sim.backend = "ray"
    set_backend(cfg, ["seed=1", "sim.backend=ray"], "batched")
    assert cfg.sim.backend == "ray"


def test_job_resources():
    assert job_cpus(None, None, 1.0) == 1 and job_cpus(4, None, 1.0) == 4 and job_cpus(None, 6, 2.0) == 6
    assert job_cpus(None, None, 2.5) == 3
    assert job_gpus(0.0, None) is None and job_gpus(0.25, None) == 1 and job_gpus(0.25, 2.0) == 2


def test_the_report_names_each_job_slurm_ended_and_counts_the_others(tmp_path):
    """Seed 0 completed; seed 1 was cancelled while it ran (its folder has no job.json); seed 2 was cancelled
    before it started (no folder at all), seed 3 while it ran but before it made its folder (a log, no folder):
    all are failed, named with their SLURM id, state and log."""
    for seed in (0, 1):
        fake_job(
            tmp_path / f"seed={seed}", ["pan.mode=mul", f"seed={seed}"], "completed" if seed == 0 else None, 0.6, 0.7
        )
    logs = tmp_path / ".submitit"
    write_jobs_record(
        tmp_path,
        [
            SlurmJob(
                n,
                ["pan.mode=mul", f"seed={n}"],
                f"7_{n}",
                state,
                str(logs / f"7_{n}" / f"7_{n}_0_log.out"),
                str(logs / f"7_{n}" / f"7_{n}_0_log.err"),
            )
            for n, state in ((0, "COMPLETED"), (1, "CANCELLED"), (2, "CANCELLED"), (3, "CANCELLED"))
        ],
    )
    (logs / "7_3").mkdir(parents=True)
    (logs / "7_3" / "7_3_0_log.out").write_text("srun: got SIGCONT\n")
    assert [job.state for job in read_jobs_record(tmp_path)] == ["COMPLETED", "CANCELLED", "CANCELLED", "CANCELLED"]
    report = sweep_report.write_report(tmp_path)
    with report.csv_path.open() as stream:
        (row,) = list(csv.DictReader(stream))
    assert (row["seeds"], row["failed"], float(row["final-accuracy-mean"])) == ("1", "3", 0.6)
    failed = [line for line in report.markdown_path.read_text().splitlines() if line.startswith("- ")]
    assert len(failed) == 3
    assert f"SLURM job 7_1 CANCELLED, log {logs}/7_1/7_1_0_log.err: no job.json" in failed[0]
    assert f"SLURM job 7_2 CANCELLED before it started, log {logs}/7_2/7_2_0_log.err" in failed[1]
    assert f"SLURM job 7_3 CANCELLED while it ran, before it made its folder, log {logs}/7_3/7_3_0_log.err" in failed[2]


def test_a_sweep_that_ran_elsewhere_has_no_slurm_record(tmp_path):
    fake_job(tmp_path / "seed=0", ["seed=0"], "completed", 0.5, 0.5)
    assert read_jobs_record(tmp_path) == []
    assert sweep_report.write_report(tmp_path).failed == 0
