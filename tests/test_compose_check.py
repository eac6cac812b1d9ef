"""The compose check's parts that need no Docker: its step records (what scripts/compose_check.sh's report reads),
how a failed critical step ends it, its metrics reading and its option checks."""

import json
import subprocess
from pathlib import Path

import compose_scenarios
import compose_stack
import pytest
from compose_scenarios import (
    CheckEnded,
    ComposeCheck,
    Recorder,
    Settings,
    StepFailed,
    clients_trained,
    metric_rows,
    parse_args,
)


def lines(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_steps_are_recorded_one_tab_separated_line_each_and_a_failed_critical_one_ends_the_check(tmp_path):
    recorder = Recorder(tmp_path / "steps.tsv")
    recorder.step("passes", lambda: "all\tfine\nhere")
    recorder.step("check fails", lambda: (_ for _ in ()).throw(StepFailed("expected 3, got 2")))
    recorder.step("command hangs", lambda: (_ for _ in ()).throw(subprocess.TimeoutExpired(["docker"], 5)))
    recorder.note("skipped (SKIP): tls")
    with pytest.raises(CheckEnded):
        recorder.step("critical fails", lambda: (_ for _ in ()).throw(StepFailed("no SuperLink")), critical=True)
    assert [(result, name, note) for result, _, name, note in lines(tmp_path / "steps.tsv")] == [
        ("PASS", "passes", "all fine here"),
        ("FAIL", "check fails", "expected 3, got 2"),
        ("FAIL", "command hangs", "TimeoutExpired: Command '['docker']' timed out after 5 seconds"),
        ("note", "", "skipped (SKIP): tls"),
        ("FAIL", "critical fails", "no SuperLink"),
    ]
    assert recorder.failed


def test_a_failed_stack_start_skips_the_rest_and_still_takes_down_what_is_left(tmp_path, monkeypatch):
    calls: list[tuple[str, ...]] = []
    leftovers = [["container:abc"], []]

    def up(self):
        raise StepFailed("compose up failed")

    def compose(self, *args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(compose_stack.Stack, "up", up)
    monkeypatch.setattr(compose_stack.Stack, "compose", compose)
    monkeypatch.setattr(compose_scenarios, "project_leftovers", lambda: leftovers.pop(0))
    (tmp_path / "logs").mkdir()
    recorder = Recorder(tmp_path / "steps.tsv")
    ComposeCheck(Settings(tmp_path), recorder).run()
    assert [(step.result, step.name) for step in recorder.steps] == [
        ("FAIL", "plain stack: up, 3 SuperNodes online"),
        ("PASS", "cleanup: down -v"),
    ]
    assert calls == [("down", "-v", "--remove-orphans", "--timeout", "10")]


SERVED_LOGS = """\x1b[2Ksupernode-0-1  | \x1b[92mINFO \x1b[0m:      [alignfl] the SuperNode asks for a message every 0.5 s ...
supernode-1-1  | INFO :      [alignfl] the SuperNode asks for a message every 0.5 s while it has none
supernode-2-1  | INFO :      [alignfl] the SuperNode asks for a message every 0.5 s while it has none
superexec-clientapp-0-1  | INFO :      [alignfl] warm ClientApp parent pid 12 ready after 3.1 s; the app's own ...
superexec-clientapp-1-1  | INFO :      [alignfl] warm ClientApp parent pid 12 ready after 3.0 s; the app's own ...
superexec-clientapp-2-1  | INFO :      [alignfl] warm ClientApp parent pid 12 ready after 3.2 s; the app's own ...
superexec-clientapp-0-1  | INFO :      [alignfl] task 1: ClientApp process pid 40 ended with code 0 after 0.9 s, 0.4 CPU-s
superexec-clientapp-2-1  | INFO :      [alignfl] task 1: ClientApp process pid 41 ended with code 0 after 0.8 s, 0.4 CPU-s
"""


@pytest.mark.parametrize(
    "dropped, problem",
    [
        (None, None),
        ("supernode-1-1", "2 of 3 SuperNodes polling faster, 3 warm parents ready, 2 warm ClientApp processes"),
        ("ready after 3.0", "3 of 3 SuperNodes polling faster, 2 warm parents ready, 2 warm ClientApp processes"),
        ("ended with code 0", "3 of 3 SuperNodes polling faster, 3 warm parents ready, 0 warm ClientApp processes"),
    ],
)
def test_a_run_must_be_served_by_faster_supernodes_and_warm_clientapp_processes(
    tmp_path, monkeypatch, dropped, problem
):
    logs = "".join(line + "\n" for line in SERVED_LOGS.splitlines() if dropped is None or dropped not in line)
    asked = []

    def compose(self, *args, **kwargs):
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, logs, "")

    monkeypatch.setattr(compose_stack.Stack, "compose", compose)
    stack = compose_stack.Stack(compose_stack.PLAIN, tmp_path, "plain")
    if problem is None:
        assert stack.served_by_warm_processes() == (
            "3 SuperNodes asking every 0.5 s, 3 warm ClientApp parents, 2 warm ClientApp processes ended with code 0"
        )
    else:
        with pytest.raises(StepFailed, match=problem):
            stack.served_by_warm_processes()
    assert asked[0][:2] == ("logs", "--no-color") and "superexec-clientapp-2" in asked[0]


def test_metrics_rows_leave_out_a_line_being_written(tmp_path):
    rows = [{"round": 0}, {"round": 1, "clients-trained": 3}, {"round": 2, "clients-trained": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"round": 3, "cl')
    assert metric_rows(tmp_path) == rows
    assert clients_trained(tmp_path) == [3, 2]
    assert metric_rows(tmp_path / "missing") == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds=0"),
        (["--kill-min-nodes", "4"], "--kill-min-nodes=4"),
        (["--kill-rounds", "1"], "--kill-rounds=1"),
        (["--skip", "tls docker"], "--skip='tls docker'"),
    ],
)
def test_bad_options_are_refused_naming_them(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        parse_args(["--work-dir", str(tmp_path), *argv])
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_defaults_are_the_settings_own(tmp_path):
    assert parse_args(["--work-dir", str(tmp_path), "--skip", "kill tls"]) == Settings(
        tmp_path.resolve(), skip=frozenset({"kill", "tls"})
    )
