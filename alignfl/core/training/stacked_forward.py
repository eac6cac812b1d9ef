"""Forward passes of many clients' models at once without ``torch.func``: client ``i``'s linear layer is slice
``i`` of one batched matrix product over the stacked weights (``torch.baddbmm``), so a step of ``k`` clients is a
few large operations. Under ``vmap`` each call of a step costs about 1 ms of Python and dispatch on a CPU, more
than a small MLP's whole step (``benchmarks/client_throughput.py``); here the plain autograd engine takes the
backward pass, as in one client's update.

Only architectures whose forward pass is written out here take this path (the MLP family of
:mod:`alignfl.models.mlp`); every other model trains under ``vmap`` (:mod:`alignfl.core.training.vectorised`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor, nn

from alignfl.models.mlp import MLP

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
    return None


def _linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` per client on features-first activations: ``h`` ``[k, in, batch]``, ``weight`` ``[k, out, in]``,
    ``bias`` ``[k, out]`` → ``[k, out, batch]``. Features first so that each weight's gradient (output gradient
    times input) comes out in the weight's own layout: ``x @ weight.T`` would give it transposed, and every
    optimiser pass over a transposed gradient strides across rows (for stacks of two clients of the 1024-wide MLP,
    two thirds of a profiled round: benchmarks/RESULTS.md, engines and speed)."""
    if bias is None:
        return torch.bmm(weight, h)
    return torch.baddbmm(bias.unsqueeze(2), weight, h)


def _mlp_forward(model: MLP, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """:meth:`alignfl.models.mlp.MLP.forward` per client; the position encodings are the model's own (one for all,
    broadcast over axis 1: the features)."""
    h = x.flatten(2).transpose(1, 2)
    for index, pan in enumerate(model.pans):
        h = torch.relu(pan(_linear(h, params[f"hidden.{index}.weight"], params.get(f"hidden.{index}.bias"))))
    return _linear(h, params["classifier.weight"], params.get("classifier.bias")).transpose(1, 2)
