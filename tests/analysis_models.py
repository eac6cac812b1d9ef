"""What the tests of alignfl/fl_app/analysis share: a seeded model on the 8x8 digits' shape, multiplicative PANs, and
the fixed points of a permutation."""

from __future__ import annotations

import torch

from alignfl.models import PanSettings, build_model

DIGITS = (1, 8, 8)
PAN_MUL = PanSettings("mul", 1.0, 0.5)


def seeded_model(name: str, pan: PanSettings | None = None, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(name, DIGITS, 10, pan).eval()


def fixed_points(perm: torch.Tensor) -> torch.Tensor:
    return perm == torch.arange(len(perm))
