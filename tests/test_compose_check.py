"""The compose check's parts that need no Docker: its step records (what scripts/compose_check.sh's report reads),
how a failed critical step ends it, its metrics reading and its option checks."""

import json
import subprocess
from pathlib import Path

import pytest

from fl_app import compose_check
from fl_app.compose_check import (
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

    monkeypatch.setattr(compose_check.Stack, "up", up)
    monkeypatch.setattr(compose_check.Stack, "compose", compose)
    monkeypatch.setattr(compose_check, "project_leftovers", lambda: leftovers.pop(0))
    (tmp_path / "logs").mkdir()
    recorder = Recorder(tmp_path / "steps.tsv")
    ComposeCheck(Settings(tmp_path), recorder).run()
    assert [(step.result, step.name) for step in recorder.steps] == [
        ("FAIL", "plain stack: up, 3 SuperNodes online"), ("PASS", "cleanup: down -v")]
    assert calls == [("down", "-v", "--remove-orphans", "--timeout", "10")]


def test_metrics_rows_leave_out_a_line_being_written(tmp_path):
    rows = [{"round": 0}, {"round": 1, "clients-trained": 3}, {"round": 2, "clients-trained": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"round": 3, "cl')
    assert metric_rows(tmp_path) == rows
    assert clients_trained(tmp_path) == [3, 2]
    assert metric_rows(tmp_path / "missing") == []


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds=0"),
    (["--kill-min-nodes", "4"], "--kill-min-nodes=4"),
    (["--kill-rounds", "1"], "--kill-rounds=1"),
    (["--skip", "tls docker"], "--skip='tls docker'"),
])
def test_bad_options_are_refused_naming_them(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        parse_args(["--work-dir", str(tmp_path), *argv])
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_defaults_are_the_settings_own(tmp_path):
    assert parse_args(["--work-dir", str(tmp_path), "--skip", "kill tls"]) == Settings(
        tmp_path.resolve(), skip=frozenset({"kill", "tls"}))
