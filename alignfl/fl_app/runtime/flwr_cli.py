"""The ``flwr`` CLI, driven from Python: submit a run, follow its log, read its final status, list and register
SuperNodes, and the ``--run-config`` text those commands take.

Every function takes the environment of the ``flwr`` commands (its ``FLWR_HOME`` names the SuperLink, see
:func:`write_connection` and :func:`alignfl.fl_app.runtime.superlink.flower_environment`), so the same calls drive a
private local SuperLink (:mod:`alignfl.fl_app.runtime.launch`), the loopback deployment
(:mod:`alignfl.fl_app.runtime.deployment`) and the compose one (``tests/compose_scenarios.py``). ``flwr run --stream``
exits 0 even when the run failed, so a run's outcome is always read from ``flwr ls``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pathspec import GitIgnoreSpec

from alignfl.fl_app.locations import checkout_root, process_folder, shipped
from alignfl.fl_app.patches import seam
from alignfl.fl_app.runtime.processes import start_process, stop_processes
from alignfl.plugins.options import ConfigError

CONNECTION = "alignfl-deployment"
"""The ``flwr`` CLI's name for a deployment's SuperLink (in the Flower home's ``config.toml``)."""
STATUS_TIMEOUT_S = 120.0
WATCH_INTERVAL_S = 0.5

Watch = Callable[[], "str | None"]
"""Called about twice a second while a run goes on: reports what it sees, and returns why the run cannot go on
(None: it can)."""


class SubmitError(RuntimeError):
    """``flwr run`` did not submit the run; the message is its output."""


def parse_overrides(text: str) -> dict[str, Any]:
    """``'k=v k2="s"'`` as ``flwr run --run-config`` reads it (TOML values), into a dict."""
    overrides: dict[str, Any] = {}
    for item in _split_pairs(text):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"run-config override {item!r} is not of the form key=value")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError as error:
            if '"' in value or "'" in value:  # a broken string, never a bare word
                raise ConfigError(
                    f"run-config override {item!r}: {value.strip()!r} is not a TOML value ({error}); "
                    'write strings in double quotes, e.g. run-name="abc"'
                ) from None
            overrides[key.strip()] = value.strip()
    return overrides


def _split_pairs(text: str) -> list[str]:
    """Split on spaces outside double quotes; an unclosed quote is a syntax error."""
    pairs, current, quoted = [], "", False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == " " and not quoted:
            if current:
                pairs.append(current)
            current = ""
        else:
            current += char
    if quoted:
        raise ConfigError(f"--run-config {text!r}: a double quote is not closed (in {current!r})")
    return pairs + ([current] if current else [])


def to_toml_pairs(values: Mapping[str, Any]) -> str:
    """The inverse of :func:`parse_overrides` for ``flwr run --run-config``."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


def flwr_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``flwr ARGS`` in :func:`~alignfl.fl_app.locations.process_folder`, its output captured."""
    return subprocess.run(
        ["flwr", *args],
        env=env,
        cwd=process_folder(),
        text=True,
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def write_connection(flwr_home: Path, address: str, root_certificates: str | None) -> None:
    """The ``flwr`` CLI's config: the SuperLink at ``address`` (TLS trusting ``root_certificates``, else
    plaintext) as the default connection, named :data:`CONNECTION`."""
    security = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n{security}\n'
    )


def online_supernodes(env: dict[str, str]) -> int:
    """How many SuperNodes the SuperLink sees online (``flwr supernode list``); 0 when it does not answer."""
    listing = flwr_cli(["supernode", "list", "--format", "json"], env)
    try:
        return sum(node["status"] == "online" for node in json.loads(listing.stdout)["nodes"])
    except (json.JSONDecodeError, KeyError):
        return 0


API_ERROR_CODE = "flwr.supercore.error.ApiErrorCode"
"""The error codes the flwr CLI's JSON output carries."""


def register_supernodes(public_keys: Sequence[str], env: dict[str, str]) -> None:
    """``flwr supernode register`` each key; a key registered before (a restarted deployment) is fine."""
    already = None
    if seam.usable("a SuperNode key registered before (a restarted deployment) is refused", API_ERROR_CODE):
        already = f"[code: {int(seam.get(API_ERROR_CODE).PUBLIC_KEY_ALREADY_IN_USE)}]"
    for key in public_keys:
        done = flwr_cli(["supernode", "register", key, CONNECTION, "--format", "json"], env)
        try:
            reply = json.loads(done.stdout)
        except json.JSONDecodeError:
            reply = {"error-message": done.stdout + done.stderr}
        if not reply.get("success") and (already is None or already not in reply.get("error-message", "")):
            raise RuntimeError(f"could not register SuperNode key {key}: {reply.get('error-message', '').strip()}")


def never_give_up() -> str | None:
    """The :data:`Watch` of a run that only its own end ends."""
    return None


def app_files(root: Path) -> Iterator[Path]:
    """The files below ``root`` outside ``.git`` and the folders its ``.gitignore`` names: those a FAB may hold.

    ``flwr run ROOT`` walks every file below ``root`` and only then drops what the ``.gitignore`` names; in a checkout
    with its virtual environment that is ~57,000 files and 3.4 CPU-seconds a submission (2-core EPYC). Skipping the
    ignored folders while walking leaves Flower's own filter the same ~400 files, so the FAB is the same, byte for
    byte (tests/test_flwr_cli.py)."""
    rules = root / ".gitignore"
    ignore = GitIgnoreSpec.from_lines(rules.read_text().splitlines() if rules.is_file() else [])
    for folder, subfolders, names in os.walk(root):
        relative = Path(folder).relative_to(root)
        subfolders[:] = [
            name for name in subfolders if name != ".git" and not ignore.match_file(f"{(relative / name).as_posix()}/")
        ]
        files = (Path(folder) / name for name in names)
        yield from (path for path in files if not path.is_symlink())  # Flower leaves links out too


@contextmanager
def staged_app(root: Path | None = None) -> Iterator[Path]:
    """A temporary folder for ``flwr run`` to build the FAB from, removed after, however the block is left.

    It holds :func:`app_files` of ``root`` (default: the checkout alignfl runs from), as hard links where the file
    system allows. An installed alignfl has no checkout: the folder then holds only the app's manifest, the
    package's copy of ``pyproject.toml`` (its ``[tool.flwr]`` sections name the installed modules, which Flower's
    processes import from this environment's site-packages)."""
    root = root or checkout_root()
    with tempfile.TemporaryDirectory(prefix="alignfl-app-") as staging:
        if root is None:
            shutil.copyfile(shipped("pyproject.toml"), Path(staging) / "pyproject.toml")
        else:
            for path in app_files(root):
                target = Path(staging) / path.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:  # another file system, or links not allowed
                    shutil.copy2(path, target)
        yield Path(staging)


def submit(run_config: Mapping[str, Any], env: dict[str, str], run_args: Sequence[str]) -> str:
    """Submit the project with ``flwr run PROJECT RUN_ARGS --run-config ...`` (``run_args``: a SuperLink connection
    name, federation settings), its FAB built from :func:`staged_app`; its run id. :class:`SubmitError` with
    ``flwr``'s output when it was not submitted."""
    with staged_app() as app:
        submitted = flwr_cli(
            ["run", str(app), *run_args, "--format", "json", "--run-config", to_toml_pairs(run_config)], env
        )
    try:
        reply = json.loads(submitted.stdout)
    except json.JSONDecodeError:
        reply = {}
    if not reply.get("success"):
        raise SubmitError((submitted.stdout + submitted.stderr).strip())
    return str(reply["run-id"])


def run_status(
    run_id: str,
    env: dict[str, str],
    watch: Watch = never_give_up,
    timeout_s: float = STATUS_TIMEOUT_S,
    interval_s: float = 1.0,
) -> tuple[str, str]:
    """``(status, details)`` of a run, waiting until it is finished (the status may lag the log) or ``timeout_s``
    passed (then the last status seen); ``aborted`` with watch's reason when it gives up first."""
    deadline = time.monotonic() + timeout_s
    while True:
        reason = watch()
        if reason is not None:
            return "aborted", reason
        listing = flwr_cli(["ls", "--run-id", run_id, "--format", "json"], env)
        try:
            run = json.loads(listing.stdout)["runs"][0]
            status, details = run["status"], run.get("status-details", "")
        except (json.JSONDecodeError, KeyError, IndexError):
            status, details = "unknown", listing.stdout + listing.stderr
        if status.startswith("finished") or time.monotonic() > deadline:
            return status, details
        time.sleep(interval_s)


def follow_log(run_id: str, env: dict[str, str], watch: Watch) -> str | None:
    """Stream the run's log to this terminal until it ends; returns watch's reason if it gave up first."""
    stream = start_process(["flwr", "log", run_id, "--stream"], env, process_folder())
    try:
        while stream.process.poll() is None:
            reason = watch()
            if reason is not None:
                return reason
            time.sleep(WATCH_INTERVAL_S)
        return None
    finally:
        stop_processes([stream], grace_s=5.0)


def submit_and_follow(
    run_config: Mapping[str, Any], env: dict[str, str], run_args: Sequence[str], watch: Watch = never_give_up
) -> tuple[str, str]:
    """:func:`submit` the run, stream its log to this terminal, and return its final status (``not-submitted``
    with ``flwr``'s output; ``aborted`` with the reason when ``watch`` gives up on it)."""
    try:
        run_id = submit(run_config, env, run_args)
    except SubmitError as error:
        return "not-submitted", str(error)
    print(f"[alignfl] run {run_id} submitted", flush=True)
    reason = follow_log(run_id, env, watch)
    if reason is not None:
        return "aborted", reason
    return run_status(run_id, env, watch)
