"""The check of ``strategy.<key>=``/``model.<key>=`` overrides before Hydra starts: a key only an algorithm or model
that the run does not choose has is refused, naming its owner and what fixes the command.

Hydra itself would only say that the key is not in the config. With an experiment preset the algorithm and model
are the preset's (its own file's, or one of its rows' under ``conf/experiment/<group>/``): the refusal then says
which preset or row picks them and which rows or files a key of the owner belongs in, since a ``strategy=``
given on the command line would replace the preset's method in every row.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra

from alignfl.fl_app.config import owned_settings, renamed_keys
from alignfl.fl_app.locations import shipped
from alignfl.fl_app.sweeps.configs import register_configs

CONF = shipped("conf")

SEARCH_PATH = "hydra.searchpath="
"""The override that adds a user's own config folders (``[file:///abs/folder,...]``) to Hydra's search path."""
_OVERRIDE = re.compile(r"^(?P<group>strategy|model)(?:\.(?P<leaf>\w+))?=(?P<value>.*)$")


def _preset_overrides(arguments: list[str]) -> list[str]:
    """The command's overrides a preset's choices are composed with: all but its swept values and its
    ``strategy.*``/``model.*``/``hydra.*`` overrides (the check is of those), except ``hydra.searchpath``, where a
    user's own presets may be."""
    return [
        a
        for a in arguments
        if a.startswith(SEARCH_PATH)
        or (not _OVERRIDE.match(a.lstrip("+~")) and not a.startswith("hydra.") and "," not in a)
    ]


@contextmanager
def _hydra_on_conf() -> Iterator[None]:
    """Hydra initialised on conf/, the generated configs in its store."""
    register_configs()
    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _choices(overrides: list[str]) -> Mapping[str, Any]:
    """Each config group's choice in the config ``overrides`` compose (inside :func:`_hydra_on_conf`)."""
    return hydra.compose("config", overrides=overrides, return_hydra_config=True).hydra.runtime.choices


def _preset(arguments: list[str]) -> str | None:
    """The command's ``+experiment=NAME`` as typed, or None."""
    return next((a for a in arguments if a.lstrip("+~").startswith("experiment=")), None)


def preset_choices(arguments: list[str]) -> dict[str, list[str]] | None:
    """The algorithm and model the command's config picks before its own ``strategy=``/``model=`` choices: the
    defaults, or what an experiment preset (``+experiment=NAME``, or one of its rows) chooses. None where that does
    not compose (an unknown preset): Hydra's own run then says what is wrong."""
    if not any(argument.lstrip("+~").startswith("experiment") for argument in arguments):
        return {"strategy": ["fedavg"], "model": ["mlp"]}  # conf/config.yaml's defaults: nothing to compose
    try:
        with _hydra_on_conf():
            choices = _choices(_preset_overrides(arguments))
    except Exception:  # Hydra's errors have no common base class
        return None
    return {group: [choices[group]] for group in ("strategy", "model")}


def _row_picks(arguments: list[str], group: str) -> tuple[str, str, dict[str, str]] | None:
    """The preset's row group that picks ``group`` (``experiment/drift_run``), its option the command composes
    with, and what each of its options picks; None where the preset's own file picks it."""
    kept = _preset_overrides(arguments)
    with _hydra_on_conf():
        loader = GlobalHydra.instance().config_loader()
        chosen = _choices(kept)
        for row in (name for name in chosen if str(name).startswith("experiment/")):
            others = [a for a in kept if a.lstrip("+~").partition("=")[0] != row]
            picks = {}
            for option in loader.get_group_options(row):
                try:
                    picks[option] = _choices([*others, f"{row}={option}"])[group]
                except Exception:  # an option that does not compose here picks nothing
                    continue
            if len(set(picks.values())) > 1:
                return row, chosen[row], picks
    return None


def _preset_fix(arguments: list[str], group: str, owners: list[str]) -> str:
    """Where a preset, not the command line, chose ``group``: which preset or row picks it, and what fixes the
    command there."""
    preset = _preset(arguments)
    rows = _row_picks(arguments, group)
    if rows is None:
        return (
            f"which the preset {preset} picks; leave the override out, or add {group}={owners[0]} to run the preset "
            f"with {owners[0]} instead"
        )
    row, chosen, picks = rows
    fitting = [option for option, pick in picks.items() if pick in owners]
    where = f"which {preset} runs where its row {row}={chosen} picks it"
    if not fitting:
        return f"{where}; no row of {row} runs {group} {owners}: leave the override out"
    files = ", ".join(f"conf/{row}/{option}.yaml" for option in fitting)
    return (
        f"{where}; to set it, run only the rows that pick {'/'.join(owners)} ({row}={','.join(fitting)}) or set it "
        f"in their files ({files})"
    )


def unowned_override(arguments: list[str]) -> str | None:
    """Why an override sets a key that the chosen algorithm or model (every choice of a swept group) lacks, or
    None; Hydra itself would only say that the key is not in the config."""
    given: dict[str, list[str]] = {}
    leaves: list[tuple[str, str]] = []
    for argument in arguments:
        match = _OVERRIDE.match(argument.lstrip("+~"))
        if match is None:
            continue
        if match["leaf"] is None:
            given[match["group"]] = match["value"].split(",")
        else:
            leaves.append((match["group"], match["leaf"]))
    if all(group in given for group, _ in leaves):  # no leaf at all, or every leaf's group chosen here
        choices = given
    else:
        preset = preset_choices(arguments)
        if preset is None:
            return None
        choices = {**preset, **given}
    owned, renamed = owned_settings(), renamed_keys()
    for group, leaf in leaves:
        key = leaf.replace("_", "-")
        owners = list(owned[key].owners) if key in owned else []
        strays = [choice for choice in choices[group] if choice not in owners]
        if not owners and key in renamed:
            now = ", ".join(f"{group}.{new.replace('-', '_')} ({group}={name})" for name, new in renamed[key].items())
            return f"override {group}.{leaf}: '{key}' was renamed; write {now}"
        if not owners:
            return f"override {group}.{leaf}: no {group} has a setting '{key}'"
        if strays:
            fix = (
                f"; set {group}={owners[0]} or leave the override out"
                if group in given or _preset(arguments) is None
                else f", {_preset_fix(arguments, group, owners)}"
            )
            return f"override {group}.{leaf}: '{key}' belongs to {group} {owners}, not to {group} {strays}{fix}"
    return None
