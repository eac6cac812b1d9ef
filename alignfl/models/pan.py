"""Position-Aware Neurons (PANs): a fixed sinusoidal encoding bound to each hidden unit.

A hidden layer with ``J`` units (channels for conv layers) gets the encoding

    e_j = A * sin(2 * pi * T * j / J),   j = 0, ..., J - 1

and its pre-activation ``h`` becomes ``h + e`` (additive) or ``h * (1 + e)``
(multiplicative) before the non-linearity. Because ``e`` is tied to the unit's
*position*, permuting hidden units no longer leaves the network's function
unchanged, which pre-aligns units across federated clients.

The encoding is a non-persistent buffer: it follows ``.to(device)`` but never
appears in ``state_dict()``, so it is never sent, averaged or permuted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from alignfl.plugins.options import check_fields, choice, non_negative, option

PAN_MODES = ("off", "add", "mul")


@dataclass(frozen=True)
class PanSettings:
    """How every hidden layer of a model applies its position encoding.

    The fields are the run config's ``pan-mode``, ``pan-t`` and ``pan-a``
    (:class:`alignfl.core.config.PanSection` borrows them): their defaults, help and
    checks are declared here only. ``mode="add"`` gives ``h + e``, ``"mul"``
    gives ``h * (1 + e)``, ``period`` is ``T``, ``amplitude`` is ``A``. ``A == 0`` or ``T == 0`` makes every ``e_j``
    zero, so those settings are as inactive as ``mode="off"``; :attr:`active`
    reports this once for all layers.
    """

    mode: str = choice("off", "off | add | mul", PAN_MODES)
    period: float = option(
        1.0, "period T: sine periods across a layer's units", non_negative, "must be a finite number >= 0"
    )
    amplitude: float = option(0.0, "amplitude A", non_negative, "must be a finite number >= 0")

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def active(self) -> bool:
        """Whether the encoding changes anything (mode on and a non-zero sine)."""
        return self.mode != "off" and self.amplitude > 0 and self.period > 0


def position_encoding(num_units: int, period: float, amplitude: float) -> Tensor:
    """The encoding vector ``e`` of length ``num_units`` (float32)."""
    positions = torch.arange(num_units, dtype=torch.float64)
    values = amplitude * torch.sin(2 * math.pi * period * positions / num_units)
    return values.to(torch.float32)


class PositionEncoding(nn.Module):
    """Apply a layer's position encoding to its pre-activation.

    Works on ``(N, J)`` (linear layers) and ``(N, J, H, W)`` (conv layers: one
    value per channel). When the settings are inactive, ``forward`` returns its
    input object unchanged, so a PAN model with PANs off is exactly a plain one.

    Parameters
    ----------
    num_units : int
        ``J``, the number of units (features or channels) of the layer.
    settings : PanSettings
        Shared by every layer of the model.
    """

    def __init__(self, num_units: int, settings: PanSettings) -> None:
        super().__init__()
        self.settings = settings
        encoding = position_encoding(num_units, settings.period, settings.amplitude)
        self.register_buffer("encoding", encoding, persistent=False)

    def forward(self, h: Tensor) -> Tensor:
        """Return ``h + e`` or ``h * (1 + e)`` broadcast over axis 1, or ``h`` when inactive. A layer that has
        grown (FedMA's matching can widen it) gets the encoding of its new width."""
        if not self.settings.active:
            return h
        if self.encoding.numel() != h.shape[1]:
            self.encoding = position_encoding(h.shape[1], self.settings.period, self.settings.amplitude).to(h.device)
        e = self.encoding.view((1, -1) + (1,) * (h.dim() - 2)).to(h.dtype)
        if self.settings.mode == "add":
            return h + e
        return h * (1 + e)

    def extra_repr(self) -> str:
        s = self.settings
        return f"units={self.encoding.numel()}, mode={s.mode}, period={s.period}, amplitude={s.amplitude}"
