"""What the server's and the clients' messages carry, and the checks a reply passes before the server uses it.

Every message names its records the same way (:data:`MODEL_RECORD`, :data:`METRICS_RECORD`,
:data:`CONFIG_RECORD`); a reply that does not fit the global model, carries other records
than expected, reports a count that is not a number, or reports other metric keys than the
other replies is dropped by the round runner with the reason these checks give.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from plugins.options import is_number

NUM_EXAMPLES = "num-examples"
NEW_CLIENT = "new-client"
"""Evaluate-reply metric (1) of a held-out client that scored the global model as a new client."""
MODEL_RECORD = "arrays"
"""The record that carries the model, in both directions (Flower's default ``arrayrecord_key``)."""
METRICS_RECORD = "metrics"
"""The record that carries a reply's metrics."""
CONFIG_RECORD = "config"
"""The record that carries the round's settings to the clients (``server-round`` and the PAN signature)."""


def arrays_problem(arrays: ArrayRecord, reference: ArrayRecord, name: str = MODEL_RECORD) -> str | None:
    """What is wrong with the ArrayRecord ``name`` measured against ``reference``, or None: the same keys and
    shapes, finite values."""
    missing, extra = sorted(set(reference) - set(arrays)), sorted(set(arrays) - set(reference))
    if missing or extra:
        return f"'{name}' keys differ from the global model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in reference.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            return f"array '{key}' of '{name}' has shape {tuple(arrays[key].shape)}, expected {tuple(ref.shape)}"
        if not np.isfinite(arrays[key].numpy()).all():  # numpy's one pass: ~10x torch.isfinite's on CPU
            return f"array '{key}' of '{name}' holds NaN or infinite values"
    return None


def metric_record_problem(content: RecordDict) -> str | None:
    """What is wrong with where a reply keeps its metrics, or None: one MetricRecord called ``"metrics"``."""
    if list(content.metric_records) != [METRICS_RECORD]:
        return f"expected one MetricRecord '{METRICS_RECORD}', got {sorted(content.metric_records)}"
    return None


def reply_problem(content: RecordDict, reference: ArrayRecord, extra_arrays: Sequence[str] = ()) -> str | None:
    """What is wrong with a training reply, or None: the ArrayRecord ``"arrays"`` that fits ``reference``,
    exactly the extra ArrayRecords the strategy expects (their contents are the strategy's to check), and one
    MetricRecord ``"metrics"`` with a positive example count."""
    expected = sorted({MODEL_RECORD, *extra_arrays})
    if sorted(content.array_records) != expected:
        return f"expected ArrayRecords {expected}, got {sorted(content.array_records)}"
    problem = metric_record_problem(content) or arrays_problem(content[MODEL_RECORD], reference)
    if problem is not None:
        return problem
    examples = content[METRICS_RECORD].get(NUM_EXAMPLES)
    if not is_number(examples) or not examples > 0:
        return f"metric '{NUM_EXAMPLES}' must be a positive number, got {examples!r}"
    return None


def evaluate_reply_problem(content: RecordDict) -> str | None:
    """What is wrong with an evaluate reply, or None: no ArrayRecord, and one MetricRecord ``"metrics"``
    whose example count is a number >= 0 (0: an empty local test split, left out of the means)."""
    if len(content.array_records):
        return f"an evaluate reply carries no ArrayRecord, got {sorted(content.array_records)}"
    problem = metric_record_problem(content)
    if problem is not None:
        return problem
    examples = content[METRICS_RECORD].get(NUM_EXAMPLES)
    if not is_number(examples) or examples < 0:
        return f"metric '{NUM_EXAMPLES}' must be a number >= 0, got {examples!r}"
    return None


def odd_metric_keys(contents: Sequence[RecordDict]) -> list[str | None]:
    """Per reply, why its metric keys differ from the most common key set (ties: the earliest), or None:
    metrics are folded only over replies that report the same keys."""
    key_sets = [frozenset(content[METRICS_RECORD].keys()) for content in contents]
    if not key_sets:
        return []
    counts = Counter(key_sets)
    common = max(key_sets, key=lambda keys: counts[keys])  # max keeps the first of equal counts
    return [
        None
        if keys == common
        else f"metric keys differ from the other replies': extra {sorted(keys - common)[:5]}, "
        f"missing {sorted(common - keys)[:5]}"
        for keys in key_sets
    ]
