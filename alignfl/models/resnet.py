"""CIFAR-style ResNet-20 with basic blocks, as used by the PANs paper (initial width 64).

Layout: 3x3 stem conv -> BN -> PAN -> ReLU; three stages of three basic blocks
(widths 64, 128, 256; the first block of stages 2 and 3 has stride 2); global
average pool; linear classifier. 1 + 9*2 convs + 1 FC = 20 weight layers.

State-dict keys: ``stem_conv``, ``stem_bn``, ``blocks.{i}.conv1/bn1/conv2/bn2``,
``blocks.{i}.shortcut.conv/shortcut.bn`` (only where the shape changes) and
``classifier``.

PAN placement: after every BatchNorm and before the ReLU or the residual add:
the stem, ``bn1`` and ``bn2`` of every block, and the BN of a conv shortcut.
Identity shortcuts get none. The stem is a hidden layer too, so it gets one.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import AxisRef, PermutationSpec, batchnorm_of, inputs_of, outputs_of
from alignfl.models.registry import MODELS, InputShape, Model


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    """3x3 conv that keeps the size at stride 1; no bias since a BatchNorm follows."""
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """conv-BN-PAN-ReLU, conv-BN-PAN, plus shortcut, then ReLU.

    The shortcut is the identity (an empty ``nn.Sequential``) when input and
    output shapes agree, otherwise 1x1 conv -> BN -> PAN.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, pan: PanSettings) -> None:
        super().__init__()
        self.conv1 = conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.pan1 = PositionEncoding(c_out, pan)
        self.conv2 = conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.pan2 = PositionEncoding(c_out, pan)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                OrderedDict(
                    conv=nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                    bn=nn.BatchNorm2d(c_out),
                    pan=PositionEncoding(c_out, pan),
                )
            )

    @property
    def has_conv_shortcut(self) -> bool:
        """Whether this block starts a new residual stream (and a new permutation group)."""
        return len(self.shortcut) > 0

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.pan1(self.bn1(self.conv1(x))))
        out = self.pan2(self.bn2(self.conv2(out)))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, stages of basic blocks, global average pool, linear classifier.

    Parameters
    ----------
    input_shape : (C, H, W)
        Any spatial size; stride-2 stages shrink it by 4 overall (8x8 -> 2x2).
    num_classes : int
        Output logits.
    stage_widths : tuple of int
        Channels of each stage; the stem has ``stage_widths[0]``.
    blocks_per_stage : int
        Basic blocks per stage.
    pan : PanSettings
        See the module notes for placement.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        stage_widths: tuple[int, ...],
        blocks_per_stage: int,
        pan: PanSettings,
    ) -> None:
        super().__init__()
        self.stem_conv = conv3x3(input_shape[0], stage_widths[0])
        self.stem_bn = nn.BatchNorm2d(stage_widths[0])
        self.stem_pan = PositionEncoding(stage_widths[0], pan)
        blocks = []
        c_in = stage_widths[0]
        for stage, c_out in enumerate(stage_widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(c_in, c_out, stride, pan))
                c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.classifier = nn.Linear(c_in, num_classes)
        self._spec = self._build_spec()

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the globally pooled last stage (MOON contrasts these)."""
        x = F.relu(self.stem_pan(self.stem_bn(self.stem_conv(x))))
        for block in self.blocks:
            x = block(x)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    def permutation_spec(self) -> PermutationSpec:
        """Residual-stream groups ``stream.{k}`` and one ``blocks.{i}.conv1`` group per block.

        ``stream.0`` is produced by the stem (conv + BN) and carried by every block
        of stage 1 through its identity shortcut: each block's ``bn2`` (and
        ``conv2`` outputs) must use it, and each block reads it through ``conv1``.
        A block with a conv shortcut reads the old stream through ``conv1`` and
        ``shortcut.conv`` and starts ``stream.{k+1}`` with its shortcut conv + BN.
        The last stream feeds the classifier (after global pooling: ``block=1``).
        ``blocks.{i}.conv1`` is the block's inner channel: conv1 out, bn1, conv2 in.
        """
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        stream, streams = "stream.0", 0
        groups: dict[str, list[AxisRef]] = {stream: [*outputs_of("stem_conv", bias=False), *batchnorm_of("stem_bn")]}
        for i, block in enumerate(self.blocks):
            p = f"blocks.{i}"
            groups[stream] += inputs_of(f"{p}.conv1")
            groups[f"{p}.conv1"] = [*outputs_of(f"{p}.conv1", bias=False), *batchnorm_of(f"{p}.bn1")]
            groups[f"{p}.conv1"] += inputs_of(f"{p}.conv2")
            if block.has_conv_shortcut:
                groups[stream] += inputs_of(f"{p}.shortcut.conv")
                streams += 1
                stream = f"stream.{streams}"
                groups[stream] = [*outputs_of(f"{p}.shortcut.conv", bias=False), *batchnorm_of(f"{p}.shortcut.bn")]
            groups[stream] += [*outputs_of(f"{p}.conv2", bias=False), *batchnorm_of(f"{p}.bn2")]
        groups[stream] += inputs_of("classifier")
        return PermutationSpec({name: tuple(refs) for name, refs in groups.items()})


def resnet20(input_shape: InputShape, num_classes: int, pan: PanSettings) -> ResNet:
    """PANs paper ResNet-20: widths 64, 128, 256, three basic blocks each."""
    return ResNet(input_shape, num_classes, (64, 128, 256), 3, pan)


MODELS.register(Model("resnet20", resnet20))
