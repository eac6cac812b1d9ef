"""VGG networks (3x3 convs, padding 1, ReLU) built on :class:`alignfl.models.cnn.PlainConvNet`.

``vgg9`` and ``vgg11`` have no normalisation, as in the FL literature; ``vgg9-bn`` and
``vgg9-gn`` add BatchNorm or one-group GroupNorm after every conv (the normalisation
ablation of Yu et al., "Fed2: Feature-Aligned Federated Learning", KDD 2021; see
:mod:`alignfl.models.cnn` for the GroupNorm's group count).
Every VGG takes the model option ``width_factor`` (run-config key ``width-factor``),
which scales every conv and hidden FC width (1: the published widths).

Max-pools that would shrink a side below 1 pixel are skipped (see :mod:`alignfl.models.cnn`),
which VGG-11 needs on 8x8 digits and 28x28 images.
"""

from __future__ import annotations

from alignfl.models.cnn import POOL, PlainConvNet, scale_widths
from alignfl.models.options import WidthOptions
from alignfl.models.pan import PanSettings
from alignfl.models.registry import MODELS, InputShape, Model

VGG9_CONFIG = (32, 64, POOL, 128, 128, POOL, 256, 256, POOL)
VGG9_HIDDEN = (512, 512)
VGG11_CONFIG = (64, POOL, 128, POOL, 256, 256, POOL, 512, 512, POOL, 512, 512, POOL)


def _vgg9(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float, norm: str) -> PlainConvNet:
    config, hidden = scale_widths(VGG9_CONFIG, width_factor), scale_widths(VGG9_HIDDEN, width_factor)
    return PlainConvNet(input_shape, num_classes, config, hidden, 3, pan, norm)


def vgg9(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> PlainConvNet:
    """FL-literature VGG-9: six convs, then FC (4096 on 32x32 input) -> 512 -> 512 -> classes."""
    return _vgg9(input_shape, num_classes, pan, width_factor, "none")


MODELS.register(Model("vgg9", vgg9, WidthOptions))


def vgg9_bn(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> PlainConvNet:
    """VGG-9 with BatchNorm after every conv."""
    return _vgg9(input_shape, num_classes, pan, width_factor, "bn")


MODELS.register(Model("vgg9-bn", vgg9_bn, WidthOptions))


def vgg9_gn(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> PlainConvNet:
    """VGG-9 with one-group GroupNorm after every conv."""
    return _vgg9(input_shape, num_classes, pan, width_factor, "gn")


MODELS.register(Model("vgg9-gn", vgg9_gn, WidthOptions))


def vgg11(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> PlainConvNet:
    """Standard VGG-11 convs with a single linear classifier, as in the PANs paper."""
    return PlainConvNet(input_shape, num_classes, scale_widths(VGG11_CONFIG, width_factor), (), 3, pan)


MODELS.register(Model("vgg11", vgg11, WidthOptions))
