"""A one-block, single-head transformer classifier (``transformer-1``).

The network of Holm, Sajjad and Matjasec, "L46 FedMA Project", project report, §3.2.

Tokens: an input ``(C, H, W)`` is read as ``H`` tokens of ``C*W`` features each
(row ``h`` of every channel is token ``h``). For the one-hot token datasets
(``(1, length, vocabulary)``, see ``majority-tokens`` in :mod:`alignfl.core.data.sources`) the
linear token embedding is exactly an embedding table lookup (plus a shared
bias); on images it embeds pixel rows, so the model runs on every dataset.

Layout (``norm_first=True``, pre-LN, the registered ``transformer-1``)::

    x = embed(tokens) + positions                      positions: fixed sinusoids
    x = x + attn.out(softmax(q k^T / sqrt(d)) v)       q, k, v from attn_norm(x)
    x = x + mlp.fc2(gelu(pan(mlp.fc1(mlp_norm(x)))))
    logits = classifier(mean over tokens of final_norm(x))

With ``norm_first=False`` (post-LN, the original transformer) the LayerNorms
follow each residual addition (``x = attn_norm(x + attn(x))``, ...) and there
is no ``final_norm``.

Permutation symmetry (:meth:`Transformer1.permutation_spec`), four groups:

``stream``
    The residual stream's ``width`` features. Every entry that writes to it or
    reads from it shares one permutation: the embedding's rows and bias, the
    positional table's columns, every LayerNorm's weight and bias (a LayerNorm's
    mean and variance do not depend on feature order), the columns of q, k, v
    and ``mlp.fc1``, the rows and bias of ``attn.out`` and ``mlp.fc2``, and the
    classifier's columns.
``attn.qk``
    The query/key features: ``q k^T`` is unchanged when q and k are permuted
    alike, so the rows and biases of both share one permutation.
``attn.v``
    The value features: the rows and bias of v and the columns of ``attn.out``.
``mlp``
    The MLP's hidden units: the rows and bias of ``mlp.fc1`` and the columns of
    ``mlp.fc2``.

q, k and v are separate linear layers (not one fused ``in_proj``) so that each
group's axes are whole tensor axes. The positional table is a *persistent*
buffer: it never trains, but it is added to the residual stream, so a stream
permutation must move its columns too, and so it is in the state dict, in the
spec, and travels with the model (clients never change it).

PANs: only the MLP's hidden units get a position encoding (after ``fc1``, before
the GELU), the one place with a neuron-style non-linearity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import AxisRef, PermutationSpec, inputs_of, outputs_of
from alignfl.models.registry import MODELS, InputShape, Model


def sinusoid_table(length: int, width: int) -> Tensor:
    """The fixed positional encoding of Vaswani et al.: ``sin``/``cos`` of ``pos / 10000^(2i/width)``."""
    positions = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    rates = torch.exp(-math.log(10_000.0) * torch.arange(0, width, 2, dtype=torch.float64) / width)
    table = torch.zeros(length, width, dtype=torch.float64)
    table[:, 0::2] = torch.sin(positions * rates)
    table[:, 1::2] = torch.cos(positions * rates[: width // 2])
    return table.to(torch.float32)


class SingleHeadAttention(nn.Module):
    """Softmax attention with one head: separate q, k, v projections and an output projection."""

    def __init__(self, width: int, head_width: int) -> None:
        super().__init__()
        self.query = nn.Linear(width, head_width)
        self.key = nn.Linear(width, head_width)
        self.value = nn.Linear(width, head_width)
        self.out = nn.Linear(head_width, width)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.out(weights @ v)


class FeedForward(nn.Module):
    """Linear -> PAN -> GELU -> Linear, applied to every token."""

    def __init__(self, width: int, hidden: int, pan: PanSettings) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.pan = PositionEncoding(hidden, pan)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        # PositionEncoding broadcasts over axis 1 (units); tokens put units last, so move them there and back.
        h = self.pan(self.fc1(x).transpose(1, 2)).transpose(1, 2)
        return self.fc2(F.gelu(h))


class Transformer1(nn.Module):
    """Token embedding + fixed positions, one single-head attention block, mean-pooled linear classifier.

    Parameters
    ----------
    input_shape : (C, H, W)
        ``H`` tokens of ``C*W`` features (see the module notes).
    num_classes : int
        Output logits.
    width : int
        Residual-stream width ``d``.
    head_width : int
        Width of q, k and v.
    hidden : int
        Hidden units of the MLP.
    norm_first : bool
        Pre-LN (True) or post-LN (False).
    pan : PanSettings
        Applied to the MLP's hidden units.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        width: int,
        head_width: int,
        hidden: int,
        norm_first: bool,
        pan: PanSettings,
    ) -> None:
        super().__init__()
        channels, length, features = input_shape
        self.norm_first = norm_first
        self.embed = nn.Linear(channels * features, width)
        self.register_buffer("positions", sinusoid_table(length, width))
        self.attn_norm = nn.LayerNorm(width)
        self.attn = SingleHeadAttention(width, head_width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = FeedForward(width, hidden, pan)
        self.final_norm = nn.LayerNorm(width) if norm_first else None
        self.classifier = nn.Linear(width, num_classes)
        self._spec = self._build_spec()

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the block's output averaged over tokens."""
        tokens = x.permute(0, 2, 1, 3).flatten(2)  # (N, C, H, W) -> (N, H, C*W)
        h = self.embed(tokens) + self.positions
        if self.norm_first:
            h = h + self.attn(self.attn_norm(h))
            h = self.final_norm(h + self.mlp(self.mlp_norm(h)))
        else:
            h = self.attn_norm(h + self.attn(h))
            h = self.mlp_norm(h + self.mlp(h))
        return h.mean(dim=1)

    def permutation_spec(self) -> PermutationSpec:
        """``stream``, ``attn.qk``, ``attn.v``, ``mlp`` (see the module notes)."""
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        norms = ["attn_norm", "mlp_norm"] + (["final_norm"] if self.norm_first else [])
        stream = [
            *outputs_of("embed"),
            AxisRef("positions", 1),
            *(AxisRef(f"{norm}.{name}", 0) for norm in norms for name in ("weight", "bias")),
            *outputs_of("attn.out"),
            *outputs_of("mlp.fc2"),
            *inputs_of("attn.query"),
            *inputs_of("attn.key"),
            *inputs_of("attn.value"),
            *inputs_of("mlp.fc1"),
            *inputs_of("classifier"),
        ]
        return PermutationSpec(
            {
                "stream": tuple(stream),
                "attn.qk": outputs_of("attn.query") + outputs_of("attn.key"),
                "attn.v": outputs_of("attn.value") + inputs_of("attn.out"),
                "mlp": outputs_of("mlp.fc1") + inputs_of("mlp.fc2"),
            }
        )


def transformer_1(input_shape: InputShape, num_classes: int, pan: PanSettings) -> Transformer1:
    """Pre-LN, width 64, one 64-wide head, MLP 256 (4x, as in the L46 FedMA Project's large model)."""
    return Transformer1(input_shape, num_classes, width=64, head_width=64, hidden=256, norm_first=True, pan=pan)


MODELS.register(Model("transformer-1", transformer_1))
