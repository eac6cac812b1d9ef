"""The app ``flwr run`` submits: built from the checkout's files without walking its ignored folders, or, for an
installed alignfl, from the package's manifest alone."""

import io
import tomllib
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

from alignfl.fl_app.locations import shipped
from alignfl.fl_app.runtime import flwr_cli
from alignfl.fl_app.runtime.flwr_cli import app_files, staged_app

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""


def test_the_staged_app_builds_the_fab_flwr_builds_from_the_checkout_byte_for_byte():
    with staged_app() as app:
        assert build_fab_from_disk(app) == build_fab_from_disk(PROJECT_ROOT)


def test_ignored_folders_and_git_are_not_walked_and_links_are_left_out(tmp_path):
    (tmp_path / ".gitignore").write_text(".venv\n/results/\n*.pyc\n")
    for name in ("pyproject.toml", "pkg/a.py", "pkg/a.pyc", ".venv/lib/x.py", "results/r.json", ".git/HEAD"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "pkg" / "link.py").symlink_to(tmp_path / "pkg" / "a.py")
    found = sorted(path.relative_to(tmp_path).as_posix() for path in app_files(tmp_path))
    assert found == [".gitignore", "pkg/a.py", "pkg/a.pyc", "pyproject.toml"]  # Flower's filter drops *.pyc itself
    with staged_app(tmp_path) as app:
        assert (app / "pkg" / "a.py").read_text() == "x" and not (app / "pkg" / "link.py").exists()
    assert not app.exists()


def test_an_installed_alignfl_stages_only_its_manifest_and_removes_it(monkeypatch):
    """Without a checkout the FAB holds the package's pyproject.toml alone: its components name the installed
    modules, which Flower's processes import from site-packages."""
    monkeypatch.setattr(flwr_cli, "checkout_root", lambda: None)
    with staged_app() as app:
        assert sorted(path.name for path in app.iterdir()) == ["pyproject.toml"]
        assert (app / "pyproject.toml").read_bytes() == shipped("pyproject.toml").read_bytes()
        with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as fab:
            manifest = tomllib.loads(fab.read("pyproject.toml").decode())
    assert manifest["tool"]["flwr"]["app"]["components"]["serverapp"].endswith("server_app:app")
    assert not app.exists()
