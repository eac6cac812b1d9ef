"""Flower's object pulls retry after 0.05 s in the processes that ask for it (fl_app/patches/object_pulls.py)."""

from __future__ import annotations

import importlib
import sys

import pytest
from flwr.supercore.constant import PULL_INITIAL_BACKOFF

from fl_app import server_app
from fl_app.patches import object_pulls

PULLS = importlib.import_module(object_pulls.PULLS_MODULE)


@pytest.fixture
def flower_pulls(monkeypatch):
    """Flower's pull functions with Flower's own first retry wait, their keyword defaults restored after the test
    (an earlier test in this process may have installed the shorter wait)."""
    for name in object_pulls.PULL_FUNCTIONS:
        function = getattr(PULLS, name)
        monkeypatch.setattr(
            function, "__kwdefaults__", {**function.__kwdefaults__, "initial_backoff": PULL_INITIAL_BACKOFF}
        )
    return [getattr(PULLS, name) for name in object_pulls.PULL_FUNCTIONS]


def test_a_missing_object_is_asked_for_again_after_the_first_retry_wait(flower_pulls, monkeypatch):
    assert object_pulls.retry_object_pulls_sooner(0.01) is None
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


def test_an_unchecked_flower_keeps_its_own_retries(flower_pulls, monkeypatch):
    monkeypatch.setattr(object_pulls, "version", lambda _: "9.9.9")
    assert (
        object_pulls.retry_object_pulls_sooner()
        == "Flower 9.9.9 is not a release it was checked against (1.41.0, 1.42.0)"
    )
    assert PULL_INITIAL_BACKOFF == 1
    assert [function.__kwdefaults__["initial_backoff"] for function in flower_pulls] == [1, 1]


def test_only_a_deployed_serverapp_retries_sooner(flower_pulls, monkeypatch):
    monkeypatch.delitem(sys.modules, "flwr.superlink.grid.http_grid", raising=False)
    server_app._retry_reply_pulls_sooner()  # a simulation: its grid pulls no objects
    assert flower_pulls[0].__kwdefaults__["initial_backoff"] == 1
    monkeypatch.setitem(sys.modules, "flwr.superlink.grid.http_grid", object())
    server_app._retry_reply_pulls_sooner()
    assert flower_pulls[0].__kwdefaults__["initial_backoff"] == object_pulls.FIRST_RETRY_S
