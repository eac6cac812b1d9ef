"""Networks for alignfl: a name registry, PAN layers and each model's permutation symmetry.

Importing this package registers every network (``mlp``, ``small-mlp``, ``twonn``,
``twocnn``, ``vgg9``, ``vgg11``, ``resnet20``, ``transformer-1``,
``psi-vgg9``, ``psi-vgg11``); build one with :func:`build_model`.
"""

from models import cnn, mlp, mobilenet, psinet, resnet, transformer, vgg  # noqa: F401  (importing registers the networks)
from models.pan import PanSettings, PositionEncoding
from models.permutation import (
    AxisRef,
    Permutable,
    PermutationSpec,
    identity_permutations,
    invert_permutations,
    permute_axis,
    permute_state,
    random_permutations,
    unit_view,
)
from models.registry import build_model, list_models  # first: model modules import it

__all__ = [
    "AxisRef",
    "PanSettings",
    "Permutable",
    "PermutationSpec",
    "PositionEncoding",
    "build_model",
    "identity_permutations",
    "invert_permutations",
    "list_models",
    "permute_axis",
    "permute_state",
    "random_permutations",
    "unit_view",
]
