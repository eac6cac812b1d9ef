"""The sweep's Hydra configs, generated from the settings classes into Hydra's ConfigStore: the common sections
of :mod:`alignfl.core.config`, every partitioner's settings in ``data``, the ``sim`` settings, every registered
algorithm under ``strategy/`` and every model under ``model/``, so their defaults are the schema's."""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

from alignfl.core.config import PARTITIONER_SECTION, SECTIONS, hydra_leaf
from alignfl.core.partitioning.partitioners import PARTITIONERS, list_partitioners
from alignfl.fl_app.sweeps.sim import SimSettings
from alignfl.fl_app.sweeps.slurm import register_launcher
from alignfl.models import list_models
from alignfl.models.registry import model_options
from alignfl.plugins.options import settings_fields
from alignfl.strategies import get_strategy, list_strategies

#: Run-config keys each job sets itself: every node must join, and the run folder goes in the job's folder.
SET_PER_JOB = ("min-available-nodes", "results-dir", "run-name")


def _section_node(section: str, settings: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The Hydra node of a settings class: leaf → default."""
    return {hydra_leaf(section, s.key): s.default for s in settings_fields(settings) if s.key not in skip}


def register_configs() -> None:
    """Put the generated configs into Hydra's ConfigStore (again after an algorithm or model registers)."""
    store = ConfigStore.instance()
    store.store(name="alignfl_run", node=_section_node("", SECTIONS[""], ("strategy", "model", *SET_PER_JOB)))
    partitioners = {}
    for name in list_partitioners():
        partitioners.update(_section_node(PARTITIONER_SECTION, PARTITIONERS.get(name).settings))
    for section, settings in SECTIONS.items():
        if section:
            node = _section_node(section, settings, SET_PER_JOB)
            store.store(
                group=section, name="default", node={**node, **partitioners} if section == PARTITIONER_SECTION else node
            )
    register_launcher()
    store.store(
        group="sim", name="default", node={f: spec.default for f, spec in SimSettings.__dataclass_fields__.items()}
    )
    for name in list_strategies():
        store.store(group="strategy", name=name, node=_section_node("", get_strategy(name).settings))
    for name in list_models():
        store.store(group="model", name=name, node=_section_node("", model_options(name)))
