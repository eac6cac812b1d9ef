"""The launcher: parsing of `--run-config` strings, refusals before anything starts, and stopping every process
it started (a tree of stand-in processes; slow: a real SuperLink and each stop signal, and SIGTERM mid-run)."""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from alignfl.core.config import RESULTS_ENV, results_root
from alignfl.fl_app.checkpoint import run_folder
from alignfl.fl_app.config import ConfigError, parse_run_config
from alignfl.fl_app.runtime import launch, processes
from alignfl.fl_app.runtime.flwr_cli import never_give_up, parse_overrides, to_toml_pairs
from alignfl.fl_app.runtime.launch import check_client_resources, prepare_config

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""


def test_overrides_parse_toml_values_and_quoted_strings():
    parsed = parse_overrides('num-server-rounds=5 lr=0.1 strategy="fedprox" run-name="a b"')
    assert parsed == {"num-server-rounds": 5, "lr": 0.1, "strategy": "fedprox", "run-name": "a b"}


def test_round_trip_through_toml_pairs():
    values = {"num-server-rounds": 5, "lr": 0.1, "strategy": "fedprox", "results-dir": "/tmp/x y"}
    assert parse_overrides(to_toml_pairs(values)) == values


def test_malformed_override_is_refused():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides("num-server-rounds")


def test_min_available_nodes_defaults_to_all_and_cannot_exceed_them(tmp_path):
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path)}, num_supernodes=7)
    assert config.min_available_nodes == 7 and config.run_name
    with pytest.raises(ConfigError, match="min-available-nodes"):
        prepare_config({"dataset": "digits", "min-available-nodes": 9}, num_supernodes=3)


@pytest.mark.parametrize("from_env", [True, False])
def test_the_launcher_and_a_plain_flwr_run_write_under_one_results_root(tmp_path, monkeypatch, from_env):
    """One default place: the launcher's run folder is ``<root>/<run-name>``, the root a plain ``flwr run``'s
    ServerApp uses too (``$ALIGNFL_RESULTS``, else ``~/alignfl-results``), never the working directory."""
    monkeypatch.chdir(tmp_path)
    if from_env:
        monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "root"))
    else:
        monkeypatch.delenv(RESULTS_ENV, raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "root" if from_env else tmp_path / "home" / "alignfl-results"
    config = prepare_config({"dataset": "digits"}, num_supernodes=2)
    assert run_folder(config) == root / config.run_name
    assert results_root(parse_run_config({})) == root  # what the ServerApp of `flwr run .` uses


def test_infeasible_partition_is_refused_before_starting(tmp_path):
    with pytest.raises(ValueError, match="dirichlet-alpha"):
        prepare_config({"dataset": "digits", "dirichlet-alpha": 0.01, "results-dir": str(tmp_path)}, num_supernodes=200)


@pytest.mark.parametrize(
    ("cpus", "gpus", "cuda", "fragment"),
    [
        (0, 0.0, False, "--num-cpus=0"),
        (1, -0.5, True, "--num-gpus=-0.5"),
        (1, 1.5, True, "whole GPUs"),
        (1, 0.25, False, "no CUDA device"),
    ],
)
def test_unschedulable_client_resources_are_refused(cpus, gpus, cuda, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_client_resources(cpus, gpus, cuda)


@pytest.mark.parametrize(("cpus", "gpus"), [(1, 0.0), (1, 0.25), (1, 1.0), (2, 2.0)])
def test_fractional_and_whole_gpus_are_accepted_where_cuda_is_and_reach_the_federation(
    cpus, gpus, monkeypatch, tmp_path
):
    """An accepted share is what Ray is given: the launcher submits it as the federation's client resources."""
    submitted: dict[str, list[str]] = {}

    @contextmanager
    def no_superlink(env):
        yield never_give_up

    def record(run_config, env, run_args, watch):
        submitted["run_args"] = list(run_args)
        return "finished:failed", "not run"

    monkeypatch.setattr(launch, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(launch, "local_superlink", no_superlink)
    monkeypatch.setattr(launch, "submit_and_follow", record)
    assert (
        launch.main(
            [
                "--num-supernodes",
                "3",
                "--num-cpus",
                str(cpus),
                "--num-gpus",
                str(gpus),
                "--run-config",
                f'dataset="digits" results-dir="{tmp_path}"',
            ]
        )
        == 1
    )  # the stand-in run failed
    assert submitted["run_args"] == [
        "--federation-config",
        f"num-supernodes=3 client-resources-num-cpus={cpus} client-resources-num-gpus={gpus}",
    ]


def test_the_ray_address_is_checked_first_and_the_superlinks_simulation_joins_that_cluster(
    monkeypatch, tmp_path, capsys
):
    """The cluster (not this machine, which has no CUDA here) decides whether a GPU share can be scheduled; Flower's
    simulation engine joins it through RAY_ADDRESS in the local SuperLink's environment."""
    asked, seen = [], {}

    def attach(address, option, cpus, gpus):
        asked.append((address, option, cpus, gpus))
        if address == "10.0.0.9:6379":
            raise ConfigError(f"{option} {address!r}: no Ray cluster answers there")
        return "10.0.0.5:6379"

    @contextmanager
    def superlink(env):
        seen["ray-address"] = env.get("RAY_ADDRESS")
        yield never_give_up

    monkeypatch.setattr(launch, "attach_to_cluster", attach)
    monkeypatch.setattr(launch, "torch_cuda_available", lambda: False)
    monkeypatch.setattr(launch, "local_superlink", superlink)
    monkeypatch.setattr(launch, "submit_and_follow", lambda *args: ("finished:failed", "not run"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_config = ["--run-config", f'dataset="digits" results-dir="{tmp_path}"']
    assert launch.main(["--ray-address", "auto", "--num-gpus", "0.5", *run_config]) == 1  # the stand-in run failed
    assert asked == [("auto", "--ray-address", 1, 0.5)] and seen == {"ray-address": "10.0.0.5:6379"}
    assert launch.main(["--ray-address", "10.0.0.9:6379", *run_config]) == 2
    assert (
        "refused before starting: --ray-address '10.0.0.9:6379': no Ray cluster answers there"
        in capsys.readouterr().err
    )
    assert seen == {"ray-address": "10.0.0.5:6379"}  # no SuperLink for the refused address


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-supernodes", "0"], "--num-supernodes must be at least 1, got 0"),
        (["--num-supernodes", "-2"], "--num-supernodes must be at least 1, got -2"),
        (["--num-gpus", "inf"], "--num-gpus=inf is not allowed"),
        (["--num-gpus", "nan"], "--num-gpus=nan is not allowed"),
    ],
)
def test_bad_launcher_options_are_refused_naming_the_option(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(launch, "torch_cuda_available", lambda: True)
    monkeypatch.setattr(launch, "local_superlink", None)  # starting one would fail loudly
    assert launch.main([*argv, "--run-config", 'dataset="digits"']) == 2
    err = capsys.readouterr().err
    assert message in err and "min-available-nodes" not in err and "Traceback" not in err


def test_launcher_refuses_gpus_without_cuda_before_starting(monkeypatch, capsys):
    monkeypatch.setattr(launch, "torch_cuda_available", lambda: False)
    monkeypatch.setattr(launch, "local_superlink", None)  # starting one would fail loudly
    assert launch.main(["--num-gpus", "0.25", "--run-config", 'dataset="digits"']) == 2
    assert "--num-gpus=0.25" in capsys.readouterr().err


# --- early refusals ---


def nothing_may_start(monkeypatch) -> None:
    """Any engine, SuperLink or Ray the launcher reached would fail the test loudly."""

    def started(*args, **kwargs):
        raise AssertionError("the launcher started a run")

    monkeypatch.setattr(launch, "local_superlink", None)
    monkeypatch.setattr(launch, "run_batched", started)
    monkeypatch.setattr(launch, "attach_to_cluster", started)


def ray_started() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_the_batched_engines_workers_must_be_positive_before_anything_starts(workers, tmp_path, monkeypatch, capsys):
    nothing_may_start(monkeypatch)
    argv = ["--backend", "batched", "--workers", workers, "--num-supernodes", "2"]
    assert launch.main([*argv, "--run-config", f'dataset="digits" results-dir="{tmp_path}"']) == 2
    err = capsys.readouterr().err
    assert f"refused before starting: --workers={workers} is not allowed: must be a positive integer" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == [] and not ray_started()


@pytest.mark.parametrize("workers", [None, 1, 4, 0, -1, True, 2.0])
def test_the_launcher_and_the_sweep_accept_the_same_worker_counts(workers):
    """One check (the batched engine's) decides for ``--workers`` and for ``sim.workers``."""
    from alignfl.fl_app.sweeps.sim import SimSettings

    def refused(check) -> bool:
        try:
            check()
        except ConfigError:
            return True
        return False

    assert refused(lambda: launch.check_workers(workers)) == refused(
        lambda: SimSettings.from_config({"workers": workers})
    )


@pytest.mark.parametrize("option", [["--vectorise", "on"], ["--vectorise", "off"], ["--workers", "2"]])
def test_batched_only_options_are_refused_without_the_batched_backend(option, tmp_path, monkeypatch, capsys):
    nothing_may_start(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        launch.main([*option, "--run-config", f'dataset="digits" results-dir="{tmp_path}"'])
    assert exit_.value.code == 2
    assert f"{option[0]} needs --backend batched" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [] and not ray_started()


@pytest.mark.parametrize("key, value", [("results-dir", "/proc/alignfl"), ("data-root", "/proc/alignfl")])
def test_an_unusable_folder_is_refused_before_starting_naming_its_key(key, value, monkeypatch, capsys):
    monkeypatch.setattr(launch, "local_superlink", None)  # starting one would fail loudly
    assert launch.main(["--num-supernodes", "2", "--run-config", f'dataset="digits" {key}="{value}"']) == 2
    err = capsys.readouterr().err
    assert f"'{key}' = '{value}'" in err and "Traceback" not in err


# --- stopping what was started ---


def gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie its parent has not collected)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


ORPHAN_MAKER = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


def test_stopping_a_tree_stops_a_child_in_its_own_session_even_after_its_parent_died():
    """Flower's SuperExec runs in a session of its own and Ray's daemons outlive their parent: a tree is
    stopped whole however it is laid out by then."""
    tree = processes.start_process(
        [sys.executable, "-c", ORPHAN_MAKER], dict(os.environ), Path.cwd(), stdout=subprocess.PIPE, text=True
    )
    child = int(tree.process.stdout.readline())
    assert set(tree.refresh()) == {tree.process.pid, child}
    tree.process.send_signal(signal.SIGKILL)  # the parent dies; its child lives on, reparented
    tree.process.wait()
    assert not gone(child)
    processes.stop_processes([tree], grace_s=5.0)
    assert gone(child)


def test_a_stop_signal_raises_once_and_waits_while_processes_are_being_stopped():
    before = signal.getsignal(signal.SIGTERM)  # an earlier test's Ray may have installed its own
    with processes.stop_signals():
        with pytest.raises(processes.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
        assert stopped.value.exit_code == 128 + signal.SIGHUP
    with processes.stop_signals():
        with pytest.raises(processes.Stopped, match="SIGTERM"), processes._SIGNALS.held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here and only records the signal
            cleaned_up = True
        assert cleaned_up
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_signal_blocks_nest_and_the_outer_one_is_back_after_the_inner_one():
    """A sweep job's block around the launcher's own: the inner one raises, the outer one's handler and state
    come back, and the Stopped already raised is not raised again by a later signal."""
    before = signal.getsignal(signal.SIGTERM)
    with processes.stop_signals():
        outer = processes._SIGNALS
        with pytest.raises(processes.Stopped, match="SIGTERM"), processes.stop_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert processes._SIGNALS is outer and outer.raised
        assert signal.getsignal(signal.SIGTERM) == outer.handle
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the block is already being left
        time.sleep(0.2)
    assert signal.getsignal(signal.SIGTERM) is before


def processes_with_environment(name: str, value: str) -> set[int]:
    """Processes whose environment holds ``name=value`` (every process the launcher starts carries its
    private FLWR_HOME)."""
    needle = f"{name}={value}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and not gone(int(entry.name)):
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_the_launcher_stops_its_superlink_and_everything_it_started_on_a_stop_signal(
    signum, monkeypatch, capsys, tmp_path, fresh_temp
):
    """A real SuperLink (it starts a SuperExec in a session of its own); the signal comes while the run is
    followed, and the launcher returns 128 + its number with nobody left behind, nothing left in the temporary
    folder, and no traceback."""
    seen: dict[str, set[int]] = {}

    def signalled_while_following(config, env, run_args, watch):
        watch()
        seen["home"] = env["FLWR_HOME"]
        deadline = time.monotonic() + 30
        while len(processes_with_environment("FLWR_HOME", env["FLWR_HOME"])) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        seen["started"] = processes_with_environment("FLWR_HOME", env["FLWR_HOME"])
        os.kill(os.getpid(), signum)
        time.sleep(60)
        raise AssertionError("the stop signal did not stop the launcher")

    monkeypatch.setattr(launch, "submit_and_follow", signalled_while_following)
    code = launch.main(["--num-supernodes", "2", "--run-config", f'dataset="digits" results-dir="{tmp_path}"'])
    assert code == 128 + signum
    assert len(seen["started"]) >= 2  # the SuperLink and its SuperExec
    assert processes_with_environment("FLWR_HOME", seen["home"]) == set()
    assert list(fresh_temp.iterdir()) == []
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_mid_run_stops_every_process_the_launcher_started(tmp_path, fresh_temp):
    """SIGTERM while Ray trains: the SuperLink, its SuperExec, flwr-simulation and Ray's processes (each
    carries the launcher's private FLWR_HOME in its environment) are all gone when the launcher exits, with
    128 + 15, no traceback, nothing in the temporary folder (Flower's home, Ray's session folder), and the way to
    resume the run."""
    with (tmp_path / "out.log").open("w") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "alignfl.fl_app.launch",
                "--num-supernodes",
                "1",  # one Ray actor: what is tested is that every process goes, not how many
                "--run-config",
                f'dataset="digits" model="small-mlp" num-server-rounds=50 results-dir="{tmp_path}" run-name="r"',
            ],
            cwd=PROJECT_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HOME": str(tmp_path / "home")},
        )  # where its clients keep their state
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None and len(metric_lines(tmp_path / "r")) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert launcher.poll() is None, (tmp_path / "out.log").read_text()
        home = next(flwr_home(pid) for pid in descendants(launcher.pid) if flwr_home(pid))
        started = processes_with_environment("FLWR_HOME", home)
        assert len(started) >= 5  # SuperLink, SuperExec, flwr-simulation, Ray's daemons and actors
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert processes_with_environment("FLWR_HOME", home) == set()
    assert list(fresh_temp.iterdir()) == []
    output = (tmp_path / "out.log").read_text()
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    assert f'resume-from="{tmp_path / "r"}"' in output


def metric_lines(folder: Path) -> list[str]:
    path = folder / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def descendants(pid: int) -> list[int]:
    """A process's children, theirs, and so on (while they are in its tree)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def flwr_home(pid: int) -> str | None:
    try:
        variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v.decode().split("=", 1)[1] for v in variables if v.startswith(b"FLWR_HOME=")), None)


def test_the_launcher_refuses_private_keys_that_git_would_commit_naming_them(exposed_key_repo, monkeypatch, capsys):
    monkeypatch.setattr(launch, "local_superlink", None)  # starting one would fail loudly
    monkeypatch.setattr(launch, "checkout_root", lambda: exposed_key_repo)
    assert launch.main(["--num-supernodes", "1", "--run-config", 'dataset="digits"']) == 2
    err = capsys.readouterr().err
    assert "refused before starting: private keys inside a git work tree that does not ignore them: " in err
    assert f"{exposed_key_repo}/keys/auth" in err and "ca.key" not in err and "Traceback" not in err


@pytest.mark.parametrize("given", [{}, {"RAY_ADDRESS": "10.0.0.1:6379"}, {"RAY_TMPDIR": "/scratch/ray"}])
def test_a_ray_a_run_starts_keeps_its_session_folder_in_a_scratch_folder_removed_after(given, fresh_temp):
    """Ray keeps its session folder after it stops: one a run starts (Flower's simulation, the batched engine's
    workers) puts it in a folder of the run's own (``RAY_TMPDIR``), removed after; a cluster that is joined
    keeps its own, and a ``RAY_TMPDIR`` the user set is theirs."""
    env = dict(given)
    with launch.own_ray_temp(env):
        if given:
            assert env == given
        else:
            folder = Path(env["RAY_TMPDIR"])
            assert folder.parent == fresh_temp and folder.is_dir()
            (folder / "ray" / "session_latest").mkdir(parents=True)  # what Ray would leave
    assert env == given and list(fresh_temp.iterdir()) == []
