"""Private keys stay out of git: make_certs.sh's default folder is outside the checkout, keys are mode 0600, a
folder git would commit is refused, and :func:`alignfl.fl_app.runtime.keys.exposed_private_keys` finds keys git would
commit."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

from alignfl.fl_app.runtime import deploy
from alignfl.fl_app.runtime.keys import default_certs, exposed_private_keys, refuse_exposed_keys
from alignfl.plugins.options import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MAKE_CERTS = PROJECT_ROOT / "scripts" / "make_certs.sh"
PRIVATE = ("ca.key", "superlink.key", "supernode-0/runtime.key", "supernode-0/auth", "supernode-1/auth")


def make_certs(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "XDG_STATE_HOME"}
    return subprocess.run(
        ["bash", str(MAKE_CERTS), *args], cwd=cwd, env={**env, "HOME": str(home)}, capture_output=True, text=True
    )


def git_repo(folder: Path, ignore: str = "") -> Path:
    folder.mkdir()
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    (folder / ".gitignore").write_text(ignore)
    return folder


def test_the_default_key_folder_is_the_users_state_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert default_certs() == tmp_path / ".local" / "state" / "alignfl" / "certs"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_certs() == tmp_path / "state" / "alignfl" / "certs"
    monkeypatch.setenv("XDG_STATE_HOME", "relative")  # the XDG rule: a relative path is ignored
    assert default_certs() == tmp_path / ".local" / "state" / "alignfl" / "certs"


def test_make_certs_with_its_defaults_writes_outside_the_checkout_with_private_keys_for_the_owner_only(
    monkeypatch, tmp_path
):
    before = exposed_private_keys(PROJECT_ROOT)
    done = make_certs("", "2", cwd=PROJECT_ROOT, home=tmp_path)  # "" is the documented default OUT_DIR
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    folder = default_certs()
    assert str(folder) in done.stdout and not folder.is_relative_to(PROJECT_ROOT)
    for name in PRIVATE:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((folder / "ca.crt").stat().st_mode) == 0o644
    assert exposed_private_keys(PROJECT_ROOT) == before  # nothing new the checkout could commit
    assert not (PROJECT_ROOT / "certs").exists() or not exposed_private_keys(PROJECT_ROOT / "certs")


def test_make_certs_refuses_a_folder_git_would_commit_and_takes_one_it_ignores(tmp_path):
    repo = git_repo(tmp_path / "repo", ignore="certs/\n")
    refused = make_certs("keys", "1", cwd=repo, home=tmp_path)
    assert refused.returncode == 2
    assert "'keys' is inside the git work tree" in refused.stderr and "does not ignore it" in refused.stderr
    assert not (repo / "keys").exists()
    nested = make_certs(str(repo / "sub" / "keys"), "1", cwd=tmp_path, home=tmp_path)  # absolute, parents missing
    assert nested.returncode == 2 and not (repo / "sub").exists()
    taken = make_certs("certs", "1", cwd=repo, home=tmp_path)
    assert taken.returncode == 0, taken.stderr
    assert (repo / "certs" / "ca.key").is_file() and exposed_private_keys(repo) == []


def test_the_checkouts_gitignore_covers_certs():
    for path in ("certs/ca.key", "deploy/certs/supernode-0/auth"):
        ignored = subprocess.run(["git", "-C", str(PROJECT_ROOT), "check-ignore", "-q", "--no-index", path])
        assert ignored.returncode == 0, path


def test_keys_that_git_would_commit_are_found_and_refused_naming_them(tmp_path):
    repo = git_repo(tmp_path / "repo", ignore="ignored/\n")
    done = make_certs(str(tmp_path / "made"), "1", cwd=tmp_path, home=tmp_path)
    assert done.returncode == 0, done.stderr
    key = (tmp_path / "made" / "supernode-0" / "auth").read_bytes()  # OpenSSH format
    pem = (tmp_path / "made" / "ca.key").read_bytes()
    for name, content in [
        ("untracked/auth", key),
        ("ignored/ca.key", pem),
        ("tracked.pem", b"-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n" + pem),
        ("notes.py", b'HEADER = "-----BEGIN PRIVATE KEY-----"\n'),  # a mention, not a key
    ]:
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_bytes(content)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.pem"], check=True)
    (repo / "untracked" / "tracked-later").write_text("no key")
    assert exposed_private_keys(repo) == [repo / "tracked.pem", repo / "untracked" / "auth"]
    assert exposed_private_keys(repo / "ignored") == []
    assert exposed_private_keys(tmp_path / "made") == []  # not in any work tree
    with pytest.raises(ConfigError, match="private keys inside a git work tree") as refused:
        refuse_exposed_keys(tmp_path / "made", repo / "untracked", None)
    assert str(repo / "untracked" / "auth") in str(refused.value) and "tracked.pem" not in str(refused.value)
    refuse_exposed_keys(repo / "ignored", tmp_path / "made")


def test_deploy_refuses_private_keys_that_git_would_commit_naming_them(exposed_key_repo, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(deploy, "deployment", None)  # starting one would fail loudly
    argv = ["--num-supernodes", "1", "--run-config", 'dataset="digits"', "--work-dir", str(tmp_path / "work")]
    monkeypatch.setattr(deploy, "checkout_root", lambda: exposed_key_repo)  # a checkout with a key in it
    assert deploy.main(argv) == 2
    err = capsys.readouterr().err
    assert f"private keys inside a git work tree that does not ignore them: {exposed_key_repo}/keys/auth" in err
    assert "ca.key" not in err and not (tmp_path / "work").exists()
    monkeypatch.setattr(deploy, "checkout_root", lambda: PROJECT_ROOT)
    assert deploy.main([*argv, "--tls", "--certs", str(exposed_key_repo / "keys")]) == 2  # --certs in a work tree
    assert f"{exposed_key_repo}/keys/auth" in capsys.readouterr().err


def test_deploys_keys_go_outside_the_checkout_by_default(tmp_path, monkeypatch, capsys):
    """deploy.sh --tls's certificate step with its defaults, in a temporary HOME: keys land in
    ~/.local/state/alignfl/certs, mode 0600, and nothing in the checkout holds a key git would commit."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    before = exposed_private_keys(PROJECT_ROOT)

    def not_started(topology, work, logs):
        raise RuntimeError(f"not started in this test; keys in {topology.certificates.folder}")

    monkeypatch.setattr(deploy, "deployment", not_started)
    argv = ["--tls", "--num-supernodes", "2", "--run-config", 'dataset="digits"', "--work-dir", str(tmp_path / "w")]
    assert deploy.main(argv) == 1
    folder = tmp_path / "home" / ".local" / "state" / "alignfl" / "certs"
    assert f"keys in {folder}" in capsys.readouterr().err
    for key in ("ca.key", "superlink.key", "supernode-1/auth", "supernode-1/runtime.key"):
        assert stat.S_IMODE((folder / key).stat().st_mode) == 0o600, key
    assert not list((tmp_path / "w").glob("**/*.key")) and exposed_private_keys(PROJECT_ROOT) == before


def test_deploy_refuses_a_certs_folder_git_would_commit_with_that_refusal_alone(tmp_path, capsys, monkeypatch):
    """``--tls --certs <checkout>/mycerts``: refused before anything starts, no folder made, no traceback."""
    repo = git_repo(tmp_path / "checkout", ignore="certs/\n")
    monkeypatch.setattr(deploy, "deployment", None)  # starting one would fail loudly
    monkeypatch.setattr(deploy, "make_certificates", None)
    certs, work = repo / "mycerts", tmp_path / "work"
    argv = ["--tls", "--certs", str(certs), "--num-supernodes", "1", "--work-dir", str(work)]
    assert deploy.main([*argv, "--run-config", 'dataset="digits"']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"refused before starting: --certs '{certs}' is not allowed: it is inside the git work tree {repo}" in err
    assert "Give a folder outside it (the default is" in err and "or one its .gitignore covers" in err
    assert not certs.exists() and not work.exists()
    assert deploy.main(["superlink", *argv, "--address", "127.0.0.1", "--serve"]) == 2  # the role that makes keys
    assert f"--certs '{certs}' is not allowed" in capsys.readouterr().err and not certs.exists()


def test_make_certificates_turns_the_scripts_refusal_into_a_config_error(tmp_path):
    from alignfl.fl_app.runtime.topology import make_certificates

    repo = git_repo(tmp_path / "checkout")
    with pytest.raises(ConfigError, match=r"make_certs.sh: '.*/keys' is inside the git work tree"):
        make_certificates(repo / "keys", 1)
    assert not (repo / "keys").exists()
