"""What a preset derives and how a config that cannot be composed is refused: the ``mul`` and ``div`` resolvers, and
one-line messages for a failed interpolation or composition.

A preset derives run-config keys from others (the drift study's rounds are
``${div:${study.budget},${train.local_epochs}}``), and a multirun composes each job from its own overrides. A bad
value there fails deep inside OmegaConf or Hydra with a message that names the derived key (or prints every option
with Hydra's search path); the pre-check instead names the key the user set, its value and what it takes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

WHOLE = "whole numbers"
REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
"""A plain reference inside an interpolation (``${study.budget}``), not a resolver call."""


class ResolverArgumentError(ValueError):
    """An argument a resolver cannot take: which resolver, the value, what it takes."""

    def __init__(self, resolver: str, value: Any, allowed: str) -> None:
        super().__init__(f"{resolver} takes {allowed}, got {value!r}")
        self.resolver, self.value, self.allowed = resolver, value, allowed


def _whole(resolver: str, value: Any) -> int:
    """``value`` as an int: an int, a float with no fraction, or the text of an int; else refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ResolverArgumentError(resolver, value, WHOLE)
    try:
        return int(value)
    except ValueError:
        raise ResolverArgumentError(resolver, value, WHOLE) from None


def multiply(*factors: Any) -> int:
    """``${mul:a,b,...}``: the product of whole numbers."""
    return math.prod(_whole("mul", factor) for factor in factors)


def divide(total: Any, part: Any) -> int:
    """``${div:total,part}``: whole-number division (the drift study's rounds = budget // E)."""
    divisor = _whole("div", part)
    if divisor == 0:
        raise ResolverArgumentError("div", part, "a divisor other than 0")
    return _whole("div", total) // divisor


def register_resolvers() -> None:
    """Make ``mul`` and ``div`` known to OmegaConf (once per process)."""
    for name, function in (("mul", multiply), ("div", divide)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


def _resolver_cause(error: BaseException) -> ResolverArgumentError | None:
    """The resolver's own error under OmegaConf's wrapping, if it is one of ours."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        if isinstance(current, ResolverArgumentError):
            return current
        seen.add(id(current))
        pending += [current.__cause__, current.__context__]
    return None


def interpolation_problem(cfg: DictConfig, error: OmegaConfBaseException) -> str:
    """One line for an interpolation of ``cfg`` that failed to resolve: the key the user set (the reference whose
    value the resolver refused) and what it takes, else the derived key, as written, and OmegaConf's reason."""
    key = error.full_key or error.key
    written = error.child_node._value() if error.child_node is not None else None
    cause = _resolver_cause(error)
    if cause is None:
        reason = str(error.msg or error).splitlines()[0]
        return f"'{key}' = {written} cannot be resolved: {reason}"
    values = {
        ref: OmegaConf.select(cfg, ref, throw_on_resolution_failure=False) for ref in REFERENCE.findall(written or "")
    }
    culprits = [ref for ref, value in values.items() if type(value) is type(cause.value) and value == cause.value]
    if culprits:
        return f"'{culprits[0]}' = {cause.value!r} is not allowed: {key} is {written}, and {cause}"
    return f"'{key}' = {written} is not allowed: {cause}"


def derivation(cfg: DictConfig, path: str, written: str) -> str:
    """``train.num_server_rounds is ${div:${study.budget},${train.local_epochs}} here (study.budget = 0,
    train.local_epochs = 1)``: how ``cfg`` derives the value at ``path``, and the values it reads."""
    values = {ref: OmegaConf.select(cfg, ref, throw_on_resolution_failure=False) for ref in REFERENCE.findall(written)}
    reads = ", ".join(f"{ref} = {value!r}" for ref, value in values.items())
    return f"{path} is {written} here" + (f" ({reads})" if reads else "")


def composition_problem(error: HydraException) -> str:
    """One line for a job Hydra cannot compose: an unknown option of a config group names the group, the value
    and the group's options; any other error is Hydra's message up to its first blank line, on one line."""
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        return f"'{group}' = '{name}' is not allowed: choose one of {list(error.options)}"
    first, _, _ = str(error).strip().partition("\n\n")
    return " ".join(line.strip() for line in first.splitlines() if line.strip())
