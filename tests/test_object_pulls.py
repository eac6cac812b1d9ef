"""Flower's object pulls retry after 0.05 s in the processes that ask for it
(alignfl/fl_app/patches/object_pulls.py)."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
from flwr.supercore.constant import PULL_INITIAL_BACKOFF

from alignfl.fl_app import server_app
from alignfl.fl_app.patches import object_pulls, seam

PULLS = importlib.import_module("flwr.supercore.inflatable.inflatable_utils")


@pytest.fixture
def flower_pulls(monkeypatch):
    """Flower's pull functions with Flower's own first retry wait, their keyword defaults restored after the test
    (an earlier test in this process may have installed the shorter wait)."""
    functions = [seam.get(key) for key in object_pulls.PATCH.needs]
    for function in functions:
        monkeypatch.setattr(
            function, "__kwdefaults__", {**function.__kwdefaults__, "initial_backoff": PULL_INITIAL_BACKOFF}
        )
    assert functions == [PULLS.pull_objects, PULLS.pull_and_inflate_object_from_tree]
    return functions


def test_a_missing_object_is_asked_for_again_after_the_first_retry_wait(flower_pulls, monkeypatch):
    assert object_pulls.retry_object_pulls_sooner(0.01)
    assert [function.__kwdefaults__["initial_backoff"] for function in flower_pulls] == [0.01, 0.01]
    answers = iter([PULLS.ObjectUnavailableError("a"), PULLS.ObjectUnavailableError("a"), b"content"])
    waits = []
    monkeypatch.setattr(PULLS.random, "uniform", lambda low, high: 0.0)  # no jitter

    def pull(object_id):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    real_wait = PULLS.threading.Event.wait
    monkeypatch.setattr(
        PULLS.threading.Event,
        "wait",
        lambda self, timeout=None: waits.append(timeout) or real_wait(self, 0 if timeout is not None else None),
    )
    assert PULLS.pull_objects(["a"], pull) == {"a": b"content"}
    assert [wait for wait in waits if wait is not None and wait < 1][:2] == [0.01, 0.02]  # then doubling as Flower's


def test_an_unchecked_flower_keeps_its_own_retries(flower_pulls, monkeypatch, caplog):
    monkeypatch.setattr(seam, "release", lambda package: "9.9.9")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not object_pulls.retry_object_pulls_sooner()
    assert (
        "object pulls retry after Flower's 1 s, not 0.05 s: Flower 9.9.9 is not a release alignfl was checked "
        "against (1.41.0, 1.42.0)" in caplog.text
    )
    assert PULL_INITIAL_BACKOFF == 1
    assert [function.__kwdefaults__["initial_backoff"] for function in flower_pulls] == [1, 1]


def test_only_a_deployed_serverapp_retries_sooner(flower_pulls, monkeypatch):
    monkeypatch.delitem(sys.modules, "flwr.superlink.grid.http_grid", raising=False)
    assert not server_app.retry_reply_pulls_sooner()  # a simulation: its grid pulls no objects
    assert flower_pulls[0].__kwdefaults__["initial_backoff"] == 1
    monkeypatch.setitem(sys.modules, "flwr.superlink.grid.http_grid", object())
    assert server_app.retry_reply_pulls_sooner()
    assert flower_pulls[0].__kwdefaults__["initial_backoff"] == object_pulls.FIRST_RETRY_S
