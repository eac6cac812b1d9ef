"""Networks for alignfl: a name registry, PAN layers and each model's permutation symmetry.

Importing this package imports every module in it, and each registers its networks
(:func:`list_models` names them), so a module dropped here adds its networks with no other
line to edit; build one with :func:`build_model`.
"""

from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import (
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
from alignfl.models.registry import build_model, list_models
from alignfl.plugins.registry import import_modules

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

import_modules(__name__, __path__)  # last: the modules import the names above
