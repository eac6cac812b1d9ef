"""The app ``flwr run`` submits: built from the checkout's files without walking its ignored folders."""

from flwr.cli.build import build_fab_from_disk

from fl_app.runtime.common import PROJECT_ROOT
from fl_app.runtime.flwr_cli import app_files, staged_app


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
