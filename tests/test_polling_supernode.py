"""The SuperNode that asks for messages every --poll-interval seconds (alignfl/fl_app/patches/polling_supernode.py)."""

from __future__ import annotations

import functools
import importlib
import logging

import pytest

from alignfl.fl_app.patches import polling_supernode, seam
from alignfl.fl_app.patches.polling_supernode import DEFAULT_NODE_POLL_S, PULL_STEP

STEP = seam.INTERNALS[PULL_STEP].name
"""The pull step's name in Flower's SuperNode loop module."""


def test_the_pull_step_is_asked_again_every_interval_until_a_message_comes(monkeypatch):
    answers = iter([None, None, None, 7])
    asked, slept = [], []
    monkeypatch.setattr(polling_supernode.time, "sleep", slept.append)

    def flower_pull(**kwargs):
        asked.append(kwargs)
        return next(answers)

    assert polling_supernode.pull_until_message(flower_pull, 0.25, state="s", receive="r") == 7
    assert asked == [{"state": "s", "receive": "r"}] * 4 and slept == [0.25] * 3


@pytest.fixture
def flower_loop(monkeypatch):
    """Flower's SuperNode loop module, its pull step restored after the test, and flower_supernode replaced by
    a stand-in that records the arguments it would parse."""
    loop = importlib.import_module(seam.INTERNALS[PULL_STEP].module)
    monkeypatch.setattr(loop, STEP, seam.get(PULL_STEP))
    calls = []
    monkeypatch.setattr(polling_supernode, "flower_supernode", lambda: calls.append(list(polling_supernode.sys.argv)))
    monkeypatch.setattr(polling_supernode, "retry_object_pulls_sooner", lambda: calls.append("pulls") and None)
    monkeypatch.setattr(polling_supernode.sys, "argv", ["python"])
    return loop, calls


FLOWER_ARGS = ["--superlink", "127.0.0.1:9092", "--isolation", "process", "--insecure"]


@pytest.mark.parametrize("argv, interval", [(["--poll-interval", "0.2"], 0.2), ([], DEFAULT_NODE_POLL_S)])
def test_the_entry_point_installs_the_faster_poll_and_passes_flowers_arguments_on(flower_loop, argv, interval):
    loop, calls = flower_loop
    flower_pull = getattr(loop, STEP)
    polling_supernode.main([*argv, *FLOWER_ARGS])
    assert calls == ["pulls", ["flower-supernode", *FLOWER_ARGS]]
    installed = getattr(loop, STEP)
    assert isinstance(installed, functools.partial) and installed.func is polling_supernode.pull_until_message
    assert installed.args == (flower_pull, interval)


def test_flowers_own_poll_leaves_the_loop_alone(flower_loop):
    loop, calls = flower_loop
    flower_pull = getattr(loop, STEP)
    polling_supernode.main(["--poll-interval", "flower", *FLOWER_ARGS])
    assert getattr(loop, STEP) is flower_pull
    assert calls == ["pulls", ["flower-supernode", *FLOWER_ARGS]]  # its object pulls still retry sooner


def test_an_unchecked_flower_runs_its_own_supernode_with_a_warning(flower_loop, monkeypatch, caplog):
    loop, calls = flower_loop
    flower_pull = getattr(loop, STEP)
    monkeypatch.setattr(seam, "release", lambda package: "9.9.9")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        polling_supernode.main(FLOWER_ARGS)
    assert getattr(loop, STEP) is flower_pull and len(calls) == 2
    assert (
        "the SuperNode polls every 3 s as Flower's own does: Flower 9.9.9 is not a release alignfl was checked "
        "against" in caplog.text
    )


@pytest.mark.parametrize("value", ["0", "-1", "3.5", "soon", "nan"])
def test_the_entry_point_refuses_a_bad_interval(flower_loop, value, capsys):
    with pytest.raises(SystemExit) as exit:
        polling_supernode.main(["--poll-interval", value, *FLOWER_ARGS])
    assert exit.value.code == 2
    assert f"--poll-interval: {value!r} is not allowed: seconds in (0, 3]" in capsys.readouterr().err
    assert flower_loop[1] == []
