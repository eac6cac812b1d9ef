"""Forward passes of many clients' models at once without ``torch.func``: client ``i``'s linear layer is slice
``i`` of one batched matrix product over the stacked weights (``torch.baddbmm``), so a step of ``k`` clients is a
few large operations. Under ``vmap`` each call of a step costs about 1 ms of Python and dispatch on a CPU, more
than a small MLP's whole step (``benchmarks/client_throughput.py``); here the plain autograd engine takes the
backward pass, as in one client's update.

Only architectures whose forward pass is written out here take this path (the MLP family of
:mod:`models.mlp`, and the conv nets of :mod:`models.cnn` without norms, e.g. FedAvg's CNN: client ``i``'s conv
is group ``i`` of one grouped convolution); every other model trains under ``vmap``
(:mod:`core.training.vectorised`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor, nn

from models.cnn import ConvStack
from models.mlp import MLP

StackedForward = Callable[[Mapping[str, Tensor], Tensor], Tensor]
"""(each parameter stacked over ``k`` clients, inputs ``[k, batch, ...]``) → logits ``[k, batch, classes]``."""


def stacked_forward(model: nn.Module) -> StackedForward | None:
    """``model``'s forward pass over stacked clients, or None where it has none (then ``vmap`` is used); a
    subclass that changes the forward pass has none."""
    if isinstance(model, MLP) and (type(model).forward, type(model).representation) == (
        MLP.forward,
        MLP.representation,
    ):
        return partial(_mlp_forward, model)
    if (
        isinstance(model, ConvStack)
        and (type(model).forward, type(model).representation) == (ConvStack.forward, ConvStack.representation)
        and all(type(norm) is nn.Identity for norm in model.norms)
    ):
        return partial(_conv_forward, model)
    return None


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` per client: ``x`` ``[k, batch, in]``, ``weight`` ``[k, out, in]``, ``bias`` ``[k, out]``."""
    if bias is None:
        return torch.bmm(x, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _mlp_forward(model: MLP, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """:meth:`models.mlp.MLP.forward` per client; the position encodings are the model's own (one for all)."""
    h = x.flatten(2)
    for index, pan in enumerate(model.pans):
        h = _linear(h, params[f"hidden.{index}.weight"], params.get(f"hidden.{index}.bias"))
        if pan.settings.active:  # an inactive encoding is the identity: skip the module call
            h = pan(h.flatten(0, 1)).view_as(h)
        h = torch.relu(h)
    return _linear(h, params["classifier.weight"], params.get("classifier.bias"))


def _conv_forward(model: ConvStack, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """:meth:`models.cnn.ConvStack.forward` per client (no norms). The feature maps of all clients are one
    ``[batch, client x channel, H, W]`` tensor; each conv is a grouped convolution, a group per client."""
    count, batch = x.shape[:2]
    h = x.transpose(0, 1).flatten(1, 2)
    for index, (conv, pan, pool) in enumerate(zip(model.convs, model.conv_pans, model.pool_after, strict=True)):
        weight, bias = params[f"convs.{index}.weight"], params.get(f"convs.{index}.bias")
        h = nn.functional.conv2d(
            h,
            weight.flatten(0, 1),
            bias.flatten() if bias is not None else None,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups * count,
        )
        if pan.settings.active:
            h = pan(h.view(batch * count, -1, *h.shape[2:])).view_as(h)
        h = torch.relu(h)
        if pool:
            h = nn.functional.max_pool2d(h, 2)
    h = h.reshape(batch, count, -1).transpose(0, 1)
    for index, pan in enumerate(model.fc_pans):
        h = _linear(h, params[f"fcs.{index}.weight"], params.get(f"fcs.{index}.bias"))
        if pan.settings.active:
            h = pan(h.flatten(0, 1)).view_as(h)
        h = torch.relu(h)
    return _linear(h, params["classifier.weight"], params.get("classifier.bias"))
