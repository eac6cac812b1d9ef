"""Typed settings with defaults, help and checks: how every layer (models, core, strategies, apps) declares options.

It sits below every layer because every layer uses it. A settings class is a frozen
dataclass whose fields are made with :func:`option`. Its run-config keys are the
field names with ``_`` written as ``-`` (``psi_depth`` is ``psi-depth``). The
defaults written in the settings classes are the only ones:
``pyproject.toml``'s run config and the Hydra configs are derived from them. A lower
layer's settings that the run config carries under its own keys (PANs, BBP-MAP) are
declared once, in that layer, and borrowed field by field (:func:`option_from`).

Key names. An algorithm's own keys carry its name as a prefix (``moon-mu``,
``fedavgm-server-lr``), so a key says whose it is; its registration refuses one
that does not (:func:`prefix_problems`). Two kinds of borrowed field keep this:

* a settings *family* declares ``key_prefix`` (``BBPSettings.key_prefix = "bbp"``):
  its fields mean the same wherever they are borrowed, so they keep one key,
  ``<key_prefix>-<field>`` (``bbp-sigma`` in ``fedma`` and in the merge tool);
* a class without ``key_prefix`` shares only a declaration (default, help, check)
  between algorithms (``alignfl.core.rounds.strategy.ServerStep``): each algorithm borrows it
  under its own prefix (``fedavgm-server-lr``, ``scaffold-server-lr``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Collection, Iterator
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A setting is wrong; the message names the key, the value and what is allowed."""


def option(default: Any, help: str, check: Callable[[Any], bool] | None = None, allowed: str = "") -> Any:
    """A settings field: its default, one line of help, and the check its value must pass (``allowed`` says
    what passes, for the error message)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "allowed": allowed})


class Choices:
    """What a choice key allows, listed when a refusal is written (a registry's names then include those
    registered after the settings class was declared)."""

    def __init__(self, names: Collection[str] | Callable[[], Collection[str]]) -> None:
        self.names = names if callable(names) else lambda: names

    def __contains__(self, value: object) -> bool:
        return value in self.names()

    def __str__(self) -> str:
        return f"choose one of {sorted(self.names())}"


def choice(default: str, help: str, names: Collection[str] | Callable[[], Collection[str]]) -> Any:
    """A settings field that takes one of ``names`` (or of the names a registry's function lists); a refusal
    lists them all."""
    choices = Choices(names)
    return dataclasses.field(
        default=default,
        metadata={"help": help, "check": lambda value: value in choices, "allowed": choices, "choices": choices},
    )


def positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def unit_interval(value: float) -> bool:
    """In (0, 1]."""
    return 0.0 < value <= 1.0


def require_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high], or a ValueError naming ``name`` and what is allowed: for arguments
    that no settings class declares (a partition's id, the number of partitions)."""
    if (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and low <= int(value)
        and (high is None or int(value) <= high)
    ):
        return int(value)
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool (Python counts True as 1; no count, rate or scale here is a
    bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def key_of(settings: type, name: str) -> str:
    """The run-config key of field ``name`` of a settings class."""
    return name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of a settings class, as the schema, the generated configs and the generated key tables see it."""

    key: str
    name: str
    kind: type
    default: Any
    help: str


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def settings_fields(settings: type) -> list[Setting]:
    """The fields of a settings class made with :func:`option`, in declaration order."""
    return list(_settings_fields(settings))


@functools.cache
def _settings_fields(settings: type) -> tuple[Setting, ...]:
    """:func:`settings_fields`, worked out once per class (every message asks for the PAN settings' fields:
    ``get_type_hints`` costs about 0.2 ms a call)."""
    hints = get_type_hints(settings)
    return tuple(
        Setting(
            key_of(settings, f.name),
            f.name,
            _KINDS[getattr(hints[f.name], "__name__", str(hints[f.name]))],
            f.default,
            f.metadata["help"],
        )
        for f in dataclasses.fields(settings)
        if "help" in f.metadata
    )


def is_kind(value: Any, kind: type) -> bool:
    """Whether ``value`` already has the field's type (an int passes as a float; a bool is never a number)."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def coerce(key: str, value: Any, kind: type) -> Any:
    """A TOML/Hydra scalar as the field's type; lossy or wrong-typed values are refused."""
    if is_kind(value, kind):
        return float(value) if kind is float else value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"run-config key '{key}' = {value!r}: expected a value of type {kind.__name__}")


def refuse(key: str, value: Any, allowed: str) -> ConfigError:
    """The error every check raises: key, value, what is allowed."""
    return ConfigError(f"run-config key '{key}' = {value!r} is not allowed: {allowed}")


def field_problems(settings: Any) -> Iterator[ConfigError]:
    """Each field whose value fails its own check."""
    for f in dataclasses.fields(settings):
        check = f.metadata.get("check")
        value = getattr(settings, f.name)
        if check is not None and not check(value):
            yield refuse(key_of(type(settings), f.name), value, f.metadata["allowed"])


def check_settings(settings: Any) -> None:
    """Raise the first field check that fails, then the class's own cross-field ``check()`` if it has one."""
    for problem in field_problems(settings):
        raise problem
    if hasattr(settings, "check"):
        settings.check()


def check_fields(settings: Any) -> None:
    """Raise ValueError naming ``Class.field`` for the first field of a settings object made in code (its
    ``__post_init__`` calls this) whose value is not of the field's type or fails the field's check."""
    declared = {f.name: f for f in dataclasses.fields(settings)}
    for setting in settings_fields(type(settings)):
        value, field = getattr(settings, setting.name), declared[setting.name]
        where = f"{type(settings).__name__}.{setting.name} = {value!r} is not allowed"
        if not is_kind(value, setting.kind):
            raise ValueError(f"{where}: must be of type {setting.kind.__name__}")
        if field.metadata["check"] is not None and not field.metadata["check"](value):
            raise ValueError(f"{where}: {field.metadata['allowed']}")


def option_from(source: type, name: str) -> Any:
    """A field that is field ``name`` of settings class ``source`` under another name (and run-config key): its
    default, help and check are ``source``'s, declared once there. A lower layer's settings (PANs, BBP-MAP)
    enter a run-config section this way; :func:`source_settings` builds the ``source`` object back."""
    declared = {f.name: f for f in dataclasses.fields(source)}
    if name not in declared or "help" not in declared[name].metadata:
        raise ValueError(f"{source.__name__} has no option {name!r}")
    return dataclasses.field(
        default=declared[name].default, metadata={**declared[name].metadata, "source": (source, name)}
    )


def prefix_problems(owner: str, settings: type) -> list[str]:
    """Why keys of ``settings`` break the key-name rule (module notes) for ``owner``, an algorithm's name.

    Parameters
    ----------
    owner : str
        The name the settings are registered under; its own keys must start with ``<owner>-``.
    settings : type
        A settings class (fields made with :func:`option` or :func:`option_from`).

    Returns
    -------
    list of str
        One sentence per key that breaks the rule, naming the key and the expected prefix; empty when all
        keep it.
    """
    problems = []
    for f in dataclasses.fields(settings):
        if "help" not in f.metadata:
            continue
        key = key_of(settings, f.name)
        source, name = f.metadata.get("source", (None, ""))
        family = getattr(source, "key_prefix", "")
        if family:
            expected = f"{family}-{key_of(source, name)}"
            if key != expected:
                problems.append(
                    f"key '{key}' borrows {source.__name__}.{name}, whose key is '{expected}' wherever it is borrowed "
                    f"(name the field {expected.replace('-', '_')})"
                )
        elif not key.startswith(f"{owner}-"):
            problems.append(
                f"key '{key}' of {settings.__name__} must start with '{owner}-': an algorithm's own keys carry its "
                f"name (name the field {owner.replace('-', '_')}_{f.name})"
            )
    return problems


def source_settings(settings: Any, source: type) -> Any:
    """The ``source`` settings object that the :func:`option_from` fields of ``settings`` describe (fields of
    ``source`` that ``settings`` does not carry keep their defaults)."""
    values = {
        f.metadata["source"][1]: getattr(settings, f.name)
        for f in dataclasses.fields(settings)
        if f.metadata.get("source", (None,))[0] is source
    }
    return source(**values)


def build_settings(settings: type, values: dict[str, Any], **parts: Any) -> Any:
    """A checked instance of ``settings`` from run-config ``values`` (keys of other classes are ignored) and
    ``parts``, fields that are no run-config keys (settings objects of the parts a run is made of)."""
    kwargs = {s.name: coerce(s.key, values[s.key], s.kind) for s in settings_fields(settings) if s.key in values}
    instance = settings(**kwargs, **parts)
    check_settings(instance)
    return instance


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """A model or algorithm with no settings of its own."""
