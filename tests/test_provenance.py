"""Which commit a run's code came from (fl_app/provenance.py), also where the code runs from an installed FAB."""

from __future__ import annotations

import subprocess

from fl_app import provenance
from fl_app.runtime.common import PROJECT_ROOT
from fl_app.runtime.superlink import flower_environment


def test_the_launchers_commit_reaches_every_flower_process_and_wins_over_the_codes_folder(tmp_path, monkeypatch):
    head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else provenance.UNKNOWN
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    assert provenance.git_commit() == expected
    assert flower_environment(tmp_path)[provenance.COMMIT_ENV] == expected
    assert provenance.checkout_commit(tmp_path) == provenance.UNKNOWN  # a FAB's install folder: not a checkout
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    assert provenance.git_commit() == "abc123"
