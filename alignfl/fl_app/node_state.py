"""What a client keeps in ``context.state``, also kept on the node's disk, so that ``resume-from`` restores it.

SCAFFOLD's c_i, MOON's previous model, SuPerFed's local model, FedPer's head and Ditto's
personal model live in ``context.state``, which lives as long as the SuperNode process
does. After every training message the ClientApp writes that state to
``<state root>/<run folder name>/partition-<id>/round-<server round>.pb`` (Flower's own
RecordDict serialisation; the last :data:`KEEP` rounds are kept). The state root is the
node-config key ``state-dir`` (default ``~/.cache/alignfl/client-state``), so a deployment
can put it on a volume; the run folder's name is ``run-name``, or the last part of
``resume-from`` in a resumed run, which is how a resumed run finds the original's files.

On the first training or evaluate message a node gets in a run (no :data:`MARKER` in its
state yet), a resumed run restores the newest snapshot of a round before that message's
``server-round``: the server resumes right after its last checkpointed round, so a snapshot
of a later round comes from rounds the resumed run repeats, and is deleted. A new run
deletes what an earlier run of the same name left. A node whose disk fails only logs it:
it keeps training, its state is then just not resumable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common.logger import log

from alignfl.core.config import RunConfig
from alignfl.fl_app.patches import seam

STATE_DIR_KEY = "state-dir"
"""Node-config key: the folder under which this node keeps client state (absolute)."""
KEEP = 2
MARKER = "alignfl.node-state"
"""``context.state`` record saying the node's state has been set up for this run (never written to disk)."""
_SNAPSHOT = re.compile(r"round-(\d+)\.pb")
TO_PROTO = "flwr.common.serde.recorddict_to_proto"
FROM_PROTO = "flwr.common.serde.recorddict_from_proto"
PROTO = "flwr.proto.recorddict_pb2.RecordDict"
"""Flower's own serialisation of a RecordDict (its wire format), which the snapshots use."""
LOST = "client state is not kept on the node's disk, so a resumed run cannot restore it"


def default_state_root() -> Path:
    """Where a node keeps client state unless its node config names a folder (``state-dir``)."""
    return Path.home() / ".cache" / "alignfl" / "client-state"


def state_root(context: Context) -> Path:
    """The node's state root: node-config ``state-dir`` (absolute) or :func:`default_state_root`."""
    configured = context.node_config.get(STATE_DIR_KEY)
    if configured is None:
        return default_state_root()
    if not isinstance(configured, str) or not Path(configured).is_absolute():
        raise ValueError(
            f"node-config key '{STATE_DIR_KEY}' = {configured!r} must be an absolute path "
            "(where this node keeps client state between runs)"
        )
    return Path(configured)


def run_folder_name(config: RunConfig) -> str:
    """The run folder's name: what the original run and its resumed runs share (empty: not known here)."""
    return Path(config.resume_from).name if config.resume_from else config.run_name


@dataclass(frozen=True)
class StateStore:
    """One client's snapshots: ``round-<r>.pb`` files in ``folder``."""

    folder: Path

    def snapshots(self) -> dict[int, Path]:
        """Round → snapshot file."""
        if not self.folder.is_dir():
            return {}
        found = {}
        for path in self.folder.iterdir():
            match = _SNAPSHOT.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def save(self, server_round: int, state: RecordDict) -> Path:
        """Write round ``server_round``'s snapshot atomically, then drop all but the newest :data:`KEEP`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"round-{server_round}.pb"
        staged = path.with_suffix(".tmp")
        with staged.open("wb") as stream:
            stream.write(seam.get(TO_PROTO)(state).SerializeToString())
            stream.flush()
            os.fsync(stream.fileno())
        staged.replace(path)
        snapshots = self.snapshots()
        for stale in sorted(snapshots)[:-KEEP]:
            snapshots[stale].unlink(missing_ok=True)
        return path

    def load(self, path: Path) -> RecordDict:
        """One snapshot, as the RecordDict it was written from."""
        proto = seam.get(PROTO)()
        proto.ParseFromString(path.read_bytes())
        return seam.get(FROM_PROTO)(proto)

    def restore_before(self, server_round: int) -> tuple[int, RecordDict] | None:
        """The newest readable snapshot of a round before ``server_round`` and its round; deletes those of
        later rounds (the resumed run trains them again)."""
        snapshots = self.snapshots()
        for later in [r for r in snapshots if r >= server_round]:
            snapshots.pop(later).unlink(missing_ok=True)
        for found in sorted(snapshots, reverse=True):
            try:
                return found, self.load(snapshots[found])
            except Exception as error:  # a truncated or foreign file: try the one before
                log(
                    WARNING,
                    "[alignfl] client state %s cannot be read (%s: %s); trying an older one",
                    snapshots[found],
                    type(error).__name__,
                    error,
                )
        return None

    def clear(self) -> None:
        """Delete every snapshot (a new run of the same name starts without them)."""
        for path in self.snapshots().values():
            path.unlink(missing_ok=True)


def state_store(context: Context, config: RunConfig, partition_id: int) -> StateStore | None:
    """Where this client's snapshots go, or None when the run folder's name is not known here (no ``run-name``
    and no ``resume-from``). The folder is always inside the state root."""
    name = run_folder_name(config)
    if not name or not seam.usable(LOST, TO_PROTO, FROM_PROTO, PROTO):
        return None
    if name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"run folder name {name!r} (from run-name or resume-from) is not a plain folder name")
    return StateStore(_client_folder(state_root(context), name, partition_id))


@lru_cache(maxsize=65536)
def _client_folder(root: Path, name: str, partition_id: int) -> Path:
    """A client's snapshot folder, resolved and checked to lie inside ``root`` once per process (resolving
    costs a system call per path component, and a client's training message asks twice)."""
    root = root.resolve()
    folder = (root / name / f"partition-{partition_id}").resolve()
    if not folder.is_relative_to(root):
        raise ValueError(f"client state folder {folder} lies outside the state root {root}")
    return folder


def begin_message(context: Context, config: RunConfig, partition_id: int, server_round: int) -> None:
    """Before a training or evaluate message: on the node's first one in this run, restore the state a
    resumed run left off with, or forget what an earlier run of the same name left."""
    if MARKER in context.state:
        return
    empty = len(context.state) == 0
    context.state[MARKER] = ConfigRecord({"run-folder": run_folder_name(config)})
    store = state_store(context, config, partition_id)
    if store is None:
        if run_folder_name(config):
            return  # the seam has said why
        log(
            INFO,
            "[alignfl] the run has no run-name: client state is not written to disk, so a resumed run "
            "cannot restore it",
        )
        return
    try:
        if not config.resume_from:
            store.clear()
            return
        restored = store.restore_before(server_round)
    except OSError as error:
        log(WARNING, "[alignfl] client state in %s: %s; this client starts without it", store.folder, error)
        return
    if restored is None:
        log(
            INFO,
            "[alignfl] resumed run: no client state before round %d in %s (the client had not trained, or "
            "its state was kept elsewhere); it starts without it",
            server_round,
            store.folder,
        )
    elif empty:
        found, state = restored
        for key, record in state.items():
            context.state[key] = record
        log(INFO, "[alignfl] restored client state of round %d from %s", found, store.folder)


def end_train(context: Context, config: RunConfig, partition_id: int, server_round: int) -> None:
    """After a training message: write the client's state (the marker left out) for a later resume. A client
    that keeps no state and never kept any writes nothing (a resumed run restores nothing either way): many
    small clients of a stateless algorithm would otherwise pay a synced file each per round."""
    store = state_store(context, config, partition_id)
    if store is None:
        return
    state = RecordDict({key: record for key, record in context.state.items() if key != MARKER})
    if not len(state) and not store.folder.is_dir():
        return
    try:
        store.save(server_round, state)
    except OSError as error:
        log(
            WARNING,
            "[alignfl] cannot write client state to %s (%s); a resumed run will not have it",
            store.folder,
            error,
        )
