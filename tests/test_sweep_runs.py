"""Sweeps that run: the report over a sweep's jobs, jobs that fail or run on another engine, a job stopped by
SIGTERM, two sweeps in one folder, and the drift study's report."""

import csv
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from alignfl.fl_app.runtime.processes import process_table
from alignfl.fl_app.sweeps import report as sweep_report
from alignfl.fl_app.sweeps.launches import (
    JOB_MARKER,
    LAUNCH_KEY,
    JobBusy,
    job_marker,
    launch_of_job,
    launch_progress,
    start_launch,
)
from alignfl.fl_app.sweeps.sweep import JOB_RECORD, run_job
from tests.sweep_jobs import ROOT, TINY, composed, fake_job, sweep


def test_report_averages_seeds_and_counts_failures(tmp_path):
    finals = {("1", "0"): [0.5, 0.7], ("1", "0.1"): [0.6, 0.6], ("4", "0"): [0.8], ("4", "0.1"): [0.4, 0.5]}
    for (t, a), values in finals.items():
        for seed, final in enumerate(values):
            fake_job(
                tmp_path / f"pan.a={a},pan.t={t}" / f"seed={seed}",
                ["pan.mode=mul", f"pan.t={t}", f"pan.a={a}", f"seed={seed}"],
                "completed",
                final,
                final + 0.1,
            )
    fake_job(tmp_path / "pan.a=0,pan.t=4" / "seed=1", ["pan.mode=mul", "pan.t=4", "pan.a=0", "seed=1"], "failed")
    fake_job(tmp_path / "pan.a=0,pan.t=4" / "seed=2", ["pan.mode=mul", "pan.t=4", "pan.a=0", "seed=2"], None)

    report = sweep_report.write_report(tmp_path)

    assert (report.jobs, report.failed, report.varying) == (9, 2, ["pan.t", "pan.a"])
    with report.csv_path.open() as stream:
        rows = {(row["pan.t"], row["pan.a"]): row for row in csv.DictReader(stream)}
    assert set(rows) == set(finals)
    for settings, values in finals.items():
        row = rows[settings]
        assert float(row["final-accuracy-mean"]) == pytest.approx(statistics.fmean(values))
        assert float(row["best-accuracy-mean"]) == pytest.approx(statistics.fmean(values) + 0.1)
        if len(values) == 1:
            assert row["final-accuracy-std"] == ""  # a sample std needs two seeds
        else:
            assert float(row["final-accuracy-std"]) == pytest.approx(statistics.stdev(values))
        assert int(row["seeds"]) == len(values)
    assert rows[("4", "0")]["failed"] == "2" and rows[("1", "0")]["failed"] == "0"
    table = report.markdown_path.read_text()
    assert table.count("\n| ") == 4 + 1  # header and one row per configuration
    assert "| 1 | 0 | 2 | 0 | 0.6000 ± 0.1414 |" in table
    assert "`pan.mode=mul`" in table
    assert report.heatmap_path is not None and report.heatmap_path.stat().st_size > 0


def test_report_command_prints_the_table_and_refuses_an_empty_folder(tmp_path, capsys):
    assert sweep_report.main([str(tmp_path)]) == 1
    for seed in (0, 1):
        fake_job(tmp_path / f"seed={seed}", [f"seed={seed}"], "completed", 0.5 + seed / 10, 0.7)
    assert sweep_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 0 | 0.5500 ± 0.0707 | 0.7000 ± 0.0000 |" in out
    assert not (tmp_path / "heatmap.png").exists()  # nothing but the seed was swept


@pytest.mark.slow
def test_two_by_two_sweep_writes_four_runs_and_a_four_row_table(tmp_path):
    result = sweep(tmp_path, *TINY, "sim.backend=inprocess", "pan.mode=mul", "pan.t=1,4", "pan.a=0,0.1")
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted(tmp_path.glob("*/seed=0/run/summary.json"))
    assert len(summaries) == 4  # one folder per configuration, the seed below it, the run folder inside the job's
    assert {path.parts[-4] for path in summaries} == {
        f"dataset=digits,pan.a={a},pan.mode=mul,pan.t={t},sim.backend=inprocess,sim.num_supernodes=2,"
        "train.num_server_rounds=1"
        for a in ("0", "0.1")
        for t in ("1", "4")
    }
    with (tmp_path / "summary.csv").open() as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 4 and all(row["seeds"] == "1" and row["failed"] == "0" for row in rows)
    assert all(float(row["final-accuracy-mean"]) > 0.2 for row in rows)  # chance is 0.1
    assert (tmp_path / "summary.md").read_text().count("\n| ") == 5
    assert (tmp_path / "heatmap.png").stat().st_size > 0


@pytest.mark.slow
def test_a_failed_job_is_reported_and_the_sweep_goes_on(tmp_path):
    # The MNIST files exist (validation passes) but are not IDX files: that job fails while loading them.
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (raw / name).write_bytes(b"not an idx file")
    result = sweep(
        tmp_path / "sweep",
        "sim.backend=inprocess",
        "sim.num_supernodes=2",
        "train.num_server_rounds=1",
        f"data.root={tmp_path / 'data'}",
        "dataset=mnist,digits",
    )
    assert result.returncode == 1
    assert "1 of 2 sweep jobs failed" in result.stderr
    with (tmp_path / "sweep" / "summary.csv").open() as stream:
        rows = {row["dataset"]: row for row in csv.DictReader(stream)}
    assert (rows["mnist"]["seeds"], rows["mnist"]["failed"]) == ("0", "1")
    assert (rows["digits"]["seeds"], rows["digits"]["failed"]) == ("1", "0")  # the job after the failure ran
    (record,) = (tmp_path / "sweep").glob("*dataset=mnist*/seed=0/job.json")
    assert json.loads(record.read_text())["status"] == "failed"


@pytest.mark.slow
def test_an_in_process_job_gives_the_metrics_of_a_ray_job(tmp_path):
    """sim.backend=inprocess skips Ray's start-up; the rounds it runs are the ones Ray's engine runs (replies in
    whatever order the actors finish), the clients each round samples and FedProx's proximal term included."""
    rows = {}
    for backend in ("ray", "inprocess"):
        cfg = composed(
            [
                *TINY,
                "strategy=fedprox",
                "model=small-mlp",
                "train.num_server_rounds=2",
                "train.fraction_train=0.5",
                "sim.num_supernodes=4",
                f"sim.backend={backend}",
                "sim.ray_cpus=2",
            ]
        )
        record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path / backend)
        assert record["status"] == "completed", record["error"]
        lines = (Path(record["run-folder"]) / "metrics.jsonl").read_text().splitlines()
        rows[backend] = [{k: v for k, v in json.loads(line).items() if k != "elapsed-s"} for line in lines]
    assert rows["inprocess"] == rows["ray"]
    assert all(row["clients-trained"] == 2 for row in rows["ray"][1:])


def _flower_home(temp: Path) -> str | None:
    """The job's private Flower home in ``temp``, once it is made."""
    from alignfl.fl_app.runtime.launch import FLWR_HOME_PREFIX

    return next((str(home) for home in temp.glob(f"{FLWR_HOME_PREFIX}*")), None)


def _carrying(home: str | None) -> set[int]:
    """The processes with ``home`` as FLWR_HOME: every process the job's SuperLink starts, and theirs."""
    from tests.test_launch import processes_with_environment

    return processes_with_environment("FLWR_HOME", home) if home else set()


def _simulating(home: str | None) -> bool:
    """Whether the job's run has started: a ``flwr-simulation`` process carries its Flower home."""
    for pid in _carrying(home):
        try:
            if b"flwr-simulation" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def _kill_carrying(home: str | None) -> None:
    """SIGKILL whatever still carries the job's Flower home (after a failure: orphans may start others)."""
    for _ in range(50):
        left = _carrying(home)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_a_ray_sweep_job_stops_every_process_it_started_and_removes_its_flower_home(tmp_path):
    """``timeout`` sends SIGTERM: once the job's private SuperLink has started the run (``flwr-simulation`` runs),
    the job exits with 128 + 15 and leaves no process of its own (SuperLink, SuperExec, flwr-simulation, Ray)
    nor its temporary Flower home behind."""
    from alignfl.fl_app.runtime import processes

    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "TMPDIR": str(temp)}
    command = [
        sys.executable,
        "-m",
        "alignfl.fl_app.sweep",
        *TINY,
        "model=small-mlp",
        "sim.backend=ray",
        "sim.ray_cpus=1",
    ]
    with (tmp_path / "job.log").open("wb") as log:
        job = processes.start_process(
            [*command, f"hydra.run.dir={tmp_path / 'job'}"], env, ROOT, stdout=log, stderr=log
        )
    home = None
    try:
        deadline = time.monotonic() + 120
        while not _simulating(home) and job.process.poll() is None and time.monotonic() < deadline:
            job.refresh()
            home = _flower_home(temp)
            time.sleep(0.2)
        started = _carrying(home)
        assert _simulating(home), (tmp_path / "job.log").read_text()
        assert len(started) >= 3  # the SuperLink, its SuperExec, flwr-simulation (and the flwr CLI)
        job.process.send_signal(signal.SIGTERM)
        code = job.process.wait(timeout=120)
        left = _carrying(home) | set(job.refresh())
    finally:  # whatever the job left, when it failed
        processes.stop_processes([job], grace_s=5.0)
        _kill_carrying(home)
    output = (tmp_path / "job.log").read_text()
    assert not left, f"processes the job started are left: {left}"
    assert not Path(home).exists()
    assert code == 128 + signal.SIGTERM, output
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    (record,) = (tmp_path / "job").glob(JOB_RECORD)
    assert json.loads(record.read_text())["error"] == "stopped by SIGTERM"


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    table, found, frontier = process_table(), set(), {pid}
    while frontier:
        frontier = {child for child, stat in table.items() if stat.ppid in frontier and not stat.zombie} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    table = process_table()
    return {pid for pid in pids if pid in table and not table[pid].zombie}


@pytest.mark.slow
def test_sigterm_to_a_parallel_sweep_stops_its_workers(tmp_path):
    """``hydra/launcher=joblib``: SIGTERM to the sweep while both workers run a job ends it with 128 + 15 and leaves
    none of its workers (nor anything they started) running."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    long_jobs = ["dataset=digits", "sim.num_supernodes=2", "train.num_server_rounds=200", "seed=0,1"]
    parallel = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    command = [sys.executable, "-m", "alignfl.fl_app.sweep", "-m", *long_jobs, *parallel, f"hydra.sweep.dir={tmp_path}"]
    workers: set[int] = set()
    with (tmp_path.parent / "sweep.log").open("wb") as log:
        sweep = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob(f"**/{JOB_MARKER}"))) < 2 and sweep.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _descendants(sweep.pid)
        assert len(list(tmp_path.glob(f"**/{JOB_MARKER}"))) == 2, (tmp_path.parent / "sweep.log").read_text()
        sweep.send_signal(signal.SIGTERM)
        code = sweep.wait(timeout=60)
        time.sleep(1)
        left = _alive(workers)
    finally:
        sweep.kill()
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)
    assert len(workers) >= 2  # the two loky workers at least
    assert code == 128 + signal.SIGTERM and not left, (code, left)


HOLD = (
    "import sys, time\nfrom pathlib import Path\nfrom alignfl.fl_app.sweeps.launches import job_marker\n"
    "with job_marker(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(120)\n"
)


def _hold_marker(folder: Path) -> subprocess.Popen:
    """Another process running the job in ``folder`` (as another sweep's job would), once it holds the marker."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_job_another_live_process_runs_is_running_and_one_whose_process_died_failed(tmp_path):
    """Two sweeps in one folder: a report written while the other sweep's job runs lists it as running, not failed,
    and the sweep that wrote it fails only for its own jobs; once that process is killed (its marker left behind),
    the job counts as not finished."""
    mine, theirs = ["pan.t=1", "seed=0"], ["pan.t=1", "seed=1"]
    fake_job(tmp_path / "pan.t=1" / "seed=0", mine, "completed", 0.5, 0.6)
    start_launch(tmp_path, [mine])
    fake_job(tmp_path / "pan.t=1" / "seed=1", theirs, None)  # started by the other sweep: no job.json yet
    holder = _hold_marker(tmp_path / "pan.t=1" / "seed=1")
    try:
        report = sweep_report.write_report(tmp_path)
        assert (report.jobs, report.failed, report.running) == (2, 0, 1)
        assert sweep_report.launch_outcome(report, tmp_path) == (1, 0)
        sweep_report.ReportSweep().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
        table = report.markdown_path.read_text()
        assert "| seeds | failed | running |" in table and "Failed jobs" not in table
        assert (
            f"Running jobs (another sweep in this folder):\n- `{tmp_path / 'pan.t=1' / 'seed=1'}`: running: pid "
            in table
        )
        with pytest.raises(JobBusy, match="being run by another live process"):
            with job_marker(tmp_path / "pan.t=1" / "seed=1"):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "pan.t=1" / "seed=1" / JOB_MARKER).is_file(), "a killed job leaves its marker"
    report = sweep_report.write_report(tmp_path)
    assert (report.failed, report.running) == (1, 0)
    assert "no job.json: the job did not finish" in report.markdown_path.read_text()
    start_launch(tmp_path, [theirs])  # a sweep of the job that died: this process's latest launch
    with pytest.raises(SystemExit, match="1 of 1 sweep jobs failed"):
        sweep_report.ReportSweep().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))


def test_each_sweep_in_a_folder_counts_its_own_jobs(tmp_path):
    """The drift study's two commands in one folder: each job finds its own launch, and each launch's progress
    line counts its own jobs alone."""
    first, second = [["seed=0"]], [["seed=1"], ["seed=2"]]
    one = start_launch(tmp_path, first)
    two = start_launch(tmp_path, second)
    assert (launch_of_job(tmp_path, ["seed=0"]), launch_of_job(tmp_path, ["seed=2"])) == (one, two)
    assert launch_of_job(tmp_path, ["seed=3"]) is None
    for seed, launch, status in ((0, one, "completed"), (1, two, "completed"), (2, two, "failed")):
        (tmp_path / f"seed={seed}").mkdir()
        (tmp_path / f"seed={seed}" / JOB_RECORD).write_text(json.dumps({"status": status, LAUNCH_KEY: launch}))
    assert launch_progress(tmp_path, one, JOB_RECORD, "completed").startswith("sweep: 1 of 1 jobs done (0 failed)")
    assert launch_progress(tmp_path, two, JOB_RECORD, "completed").startswith("sweep: 2 of 2 jobs done (1 failed)")
    assert launch_progress(tmp_path, None, JOB_RECORD, "completed") == "sweep: 3 jobs done (1 failed)"


def test_a_job_writes_its_launch_and_leaves_a_folder_another_process_runs_to_it(tmp_path):
    """run_job records the launch that ran it and removes its marker; in a folder another live process is
    running it runs nothing and writes no record of its own."""
    cfg = composed(TINY)
    holder = _hold_marker(tmp_path / "busy")
    try:
        record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path / "busy", launch="L")
    finally:
        holder.kill()
        holder.wait()
    assert record["status"] == "failed" and "being run by another live process (pid " in record["error"]
    assert not (tmp_path / "busy" / JOB_RECORD).exists()
    (tmp_path / "job" / "run").mkdir(parents=True)
    (tmp_path / "job" / "run" / "summary.json").write_text("{}")  # an earlier launch finished it: kept, not run
    (tmp_path / "job" / JOB_RECORD).write_text(json.dumps({"status": "completed", "job-wall-time-s": 1.0}))
    record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path / "job", launch="L")
    assert record["status"] == "completed" and json.loads((tmp_path / "job" / JOB_RECORD).read_text())["launch"] == "L"
    assert not (tmp_path / "job" / JOB_MARKER).exists()


def _drift_report():
    """benchmarks/drift_report.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("drift_report", ROOT / "benchmarks" / "drift_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drift_report_refuses_a_folder_without_the_studys_jobs_and_leaves_other_jobs_out(tmp_path, capsys):
    drift_report = _drift_report()
    fake_job(tmp_path / "pan.t=1" / "seed=0", ["pan.t=1", "seed=0"], "completed", 0.5, 0.6)
    with pytest.raises(SystemExit) as refused:
        drift_report.main([str(tmp_path)])
    assert refused.value.code == 2
    assert "holds no drift-study job (one whose overrides set experiment/drift_run" in capsys.readouterr().err
    for run, final in (("mlp-fedavg", 0.7), ("mlp-pans", 0.75)):
        study = tmp_path / run / "seed=0"
        fake_job(
            study,
            [f"experiment/drift_run={run}", "experiment/drift_epochs=e5", "data.dirichlet_alpha=0.5", "seed=0"],
            "completed",
            final,
            final,
        )
        summary = {"final-accuracy": final, "best-accuracy": final, "run-folder": str(study / "run")}
        (study / "run" / "summary.json").write_text(json.dumps(summary))
        moved = [{"round": 1, "client-units-moved-between": {"h0": 0.5, "h1": 0.0}, "units-moved": 0.2}]
        moved += [{"round": 2, "client-units-moved-between": {"h0": 0.1, "h1": 0.1}, "units-moved": 0.0}]
        rows = [{"round": 0, "accuracy": 0.1}, *(moved if run == "mlp-pans" else [])]
        (study / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drift_report.main([str(tmp_path)]) == 0
    text = (tmp_path / "drift.md").read_text()
    assert (
        "| fedavg | 70.0 (+0.0) |" in text
        and "| pans | 75.0 (+5.0) |" in text
        and "2 jobs, 0 failed, 0 running." in text
    )
    # units moved between clients: (25 % + 10 %) / 2 over the rounds, round 1's 25 % apart; the matching's 20 % and 0 %
    assert "| fedavg | not logged |" in text and "| pans | between 17.5 [25.0], matching 10.0 |" in text
    assert (tmp_path / "drift_heatmap.png").stat().st_size > 0
    assert "1 other jobs in the folder are not the drift study's: left out." in text


def test_the_drift_report_reads_gains_seed_against_seed_and_ot_fusions_own_moves(tmp_path):
    """A method run on fewer seeds than FedAvg gains over FedAvg's same seeds (not over its mean of all), with the
    paired gains' sd, and says on how many; OT fusion's units moved are its transport's mass off the diagonal."""
    drift_report = _drift_report()
    finals = {"mlp-fedavg": {0: 0.70, 1: 0.60, 2: 0.80}, "mlp-pans": {0: 0.72, 1: 0.65}, "mlp-otfusion": {0: 0.69}}
    transported = [{"round": 1, "transport-off-diagonal": {"h0": 0.2, "h1": 0.0}}]
    transported += [{"round": 2, "transport-off-diagonal": {"h0": 0.0, "h1": 0.0}}]
    for run, seeds in finals.items():
        for seed, final in seeds.items():
            axes = [f"experiment/drift_run={run}", "experiment/drift_epochs=e5", "data.dirichlet_alpha=0.5"]
            job = tmp_path / run / f"seed={seed}"
            fake_job(job, [*axes, f"seed={seed}"], "completed", final, final)
            summary = {"final-accuracy": final, "run-folder": str(job / "run")}
            (job / "run" / "summary.json").write_text(json.dumps(summary))
            rows = [{"round": 0, "accuracy": 0.1}, *(transported if run == "mlp-otfusion" else [])]
            (job / "run" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert drift_report.main([str(tmp_path)]) == 0
    text = (tmp_path / "drift.md").read_text()
    # pans: +2 and +5 points on seeds 0 and 1 (mean 3.5, sd 2.1); against FedAvg's mean of three it would be -1.5
    assert "| pans | 68.5 ± 4.9 (+3.5 ± 2.1 on 2 seeds) |" in text and "| fedavg | 70.0 ± 10.0 (+0.0 ± 0.0) |" in text
    # OT fusion's own moves: 10 % of the mass off the diagonal in round 1, none in round 2
    assert "| otfusion | 69.0 (-1.0 on 1 seed) |" in text and "| otfusion | OT 5.0 [10.0] |" in text
