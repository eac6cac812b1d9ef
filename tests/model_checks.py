"""Helpers shared by the model tests."""

import torch
from torch import nn


def randomise(model: nn.Module) -> nn.Module:
    """Eval mode, He weights, random biases and norm entries, so a mis-permuted entry shows in the output.

    Default BN/GN values (weight 1, bias 0, mean 0, var 1) are the same for every channel, so a mis-permuted
    norm would go unnoticed; and PyTorch's default init shrinks the signal through deep plain nets (VGG-11's
    outputs barely depend on its first layer), which would hide errors there.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            if isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
    return model.eval()
