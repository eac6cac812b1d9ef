"""Keys a preset fixes (``study.fixed``): the protocol it reproduces, which a command-line override would replace
without a word (FedMA's published protocol starts every client from its own initialisation; the same sweep with
``train.client_init=global`` is another experiment, and its table would still carry the preset's name)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

FIXED = "study.fixed"


def fixed_key_problem(config: DictConfig) -> str | None:
    """The first command-line override of a key the preset lists under :data:`FIXED`, as one line naming the
    override and the preset; None when there is none."""
    fixed = set(OmegaConf.select(config, FIXED, default=None) or ())
    if not fixed:
        return None
    # as typed: an override may hold ${...} that only its job resolves
    for override in OmegaConf.to_container(config.hydra.overrides.task, resolve=False):
        key = override.lstrip("+~").partition("=")[0]
        if key in fixed:
            preset = config.hydra.runtime.choices.get("experiment", "the preset")
            return (
                f"{override} contradicts preset {preset!r}, which fixes {key} (its protocol, {FIXED}): "
                f"drop the override, or sweep the methods without the preset to vary {key}"
            )
    return None
