"""What the BBP-MAP tests share: small MLPs and conv nets (with and without BatchNorm) on a 6x6 input, their
states drawn at weight scale :data:`STD`, prototype rows for the matching alone, and a model's head."""

from __future__ import annotations

import torch
from torch import Tensor

from alignfl.models import PanSettings
from alignfl.models.cnn import POOL, PlainConvNet
from alignfl.models.mlp import MLP
from alignfl.models.protocol import head_of

SHAPE = (1, 6, 6)
CLASSES = 3
STD = 2.0


def prototype_rows(clients: int, widths: list[int], dims: int, pool: int, seed: int) -> list[Tensor]:
    """Each client's units: a random choice of ``pool`` shared prototypes, plus noise, in random order."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = STD * torch.randn(pool, dims, generator=generator, dtype=torch.float64)
    return [
        prototypes[torch.randperm(pool, generator=generator)[:width]]
        + 0.3 * torch.randn(width, dims, generator=generator, dtype=torch.float64)
        for width in widths[:clients]
    ]


def random_state(model: torch.nn.Module, seed: int) -> dict[str, Tensor]:
    """The model's state with every floating entry redrawn as N(0, STD^2), so every unit is distinct."""
    generator = torch.Generator().manual_seed(seed)
    return {
        key: STD * torch.randn(value.shape, generator=generator) if value.is_floating_point() else value.clone()
        for key, value in model.state_dict().items()
    }


def disjoint_state(model: torch.nn.Module, part: int, parts: int) -> dict[str, Tensor]:
    """A random state whose first layer reads only the ``part``-th of ``parts`` slices of each unit's inputs
    (no bias): clients made with different parts have orthogonal first-layer units, and so different units
    in every later layer too (their inputs do not overlap once scattered)."""
    state = random_state(model, seed=10 + part)
    first = next(iter(model.permutation_spec().groups))
    weight = state[f"{first}.weight"].reshape(state[f"{first}.weight"].shape[0], -1)
    mine = torch.arange(weight.shape[1]) * parts // weight.shape[1] == part
    weight[:, ~mine] = 0.0
    state[f"{first}.bias"].zero_()
    return state


def head(model: torch.nn.Module) -> tuple[str, ...]:
    return head_of(model).keys


def mlp(hidden: tuple[int, ...]) -> MLP:
    return MLP(SHAPE, CLASSES, hidden, PanSettings())


def cnn(convs: tuple[int, int], fc: int, norm: str = "none") -> PlainConvNet:
    return PlainConvNet(SHAPE, CLASSES, (convs[0], POOL, convs[1]), (fc,), 3, PanSettings(), norm)


MODELS = {"mlp": lambda: mlp((8, 6)), "cnn": lambda: cnn((4, 5), 6), "cnn-bn": lambda: cnn((4, 5), 6, "bn")}
