"""VGG networks (3x3 convs, padding 1, ReLU, no BatchNorm) built on :class:`models.cnn.PlainConvNet`.

Max-pools that would shrink a side below 1 pixel are skipped (see :mod:`models.cnn`),
which VGG-11 needs on 8x8 digits and 28x28 images.
"""

from __future__ import annotations

from models.cnn import POOL, PlainConvNet
from models.pan import PanSettings
from models.registry import InputShape, register_model

VGG9_CONFIG = (32, 64, POOL, 128, 128, POOL, 256, 256, POOL)
VGG11_CONFIG = (64, POOL, 128, POOL, 256, 256, POOL, 512, 512, POOL, 512, 512, POOL)


@register_model("vgg9")
def vgg9(input_shape: InputShape, num_classes: int, pan: PanSettings) -> PlainConvNet:
    """FL-literature VGG-9: six convs, then FC (4096 on 32x32 input) -> 512 -> 512 -> classes."""
    return PlainConvNet(input_shape, num_classes, VGG9_CONFIG, (512, 512), 3, pan)


@register_model("vgg11")
def vgg11(input_shape: InputShape, num_classes: int, pan: PanSettings) -> PlainConvNet:
    """Standard VGG-11 convs with a single linear classifier, as in the PANs paper."""
    return PlainConvNet(input_shape, num_classes, VGG11_CONFIG, (), 3, pan)
