"""What personalised baselines (FedPer, Ditto) report from their evaluate hook, in one shape.

``local-*`` scores the received global model, as every strategy does; ``personal-*``
scores the client's own model on the same local test split, with ECE and MCE. A
client that has never trained has no personal model yet and, as a new client
would, uses the global one (``personal-trained`` = 0 says so).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from alignfl.core.data import ClientData
from alignfl.core.metrics.calibration import classification_scores


def personal_scores(
    global_model: nn.Module,
    personal_model: nn.Module | None,
    data: ClientData,
    device: torch.device,
) -> dict[str, Any]:
    """Global and personal accuracy, ECE, MCE on the local test split (personal = global when None)."""
    accuracy, ece, mce, loss = classification_scores(global_model, data.test_x, data.test_y, device)
    personal = (
        (accuracy, ece, mce)
        if personal_model is None
        else classification_scores(personal_model, data.test_x, data.test_y, device)[:3]
    )
    return {
        "local-loss": loss,
        "local-accuracy": accuracy,
        "local-ece": ece,
        "local-mce": mce,
        "personal-accuracy": personal[0],
        "personal-ece": personal[1],
        "personal-mce": personal[2],
        "personal-trained": int(personal_model is not None),
    }
