"""Option groups that several model families share (each model's own options live beside it)."""

from __future__ import annotations

import dataclasses

from alignfl.plugins.options import option, positive


@dataclasses.dataclass(frozen=True)
class WidthOptions:
    """Models whose hidden widths scale."""

    width_factor: float = option(
        1.0, "every hidden width times this (1: the published widths)", positive, "must be a finite number > 0"
    )


@dataclasses.dataclass(frozen=True)
class BiasOptions:
    """Nets the SuPerFed authors use without biases."""

    bias: bool = option(
        True, "whether every conv and linear layer has a bias (the SuPerFed authors' TwoNN and TwoCNN have none)"
    )
