"""What the server's and the clients' messages carry, and the checks a reply passes before the server uses it.

Every message names its records the same way (:data:`MODEL_RECORD`, :data:`METRICS_RECORD`,
:data:`CONFIG_RECORD`); a reply that does not fit the global model, carries other records
than expected, reports a count that is not a number, or reports other metric keys than the
other replies is dropped by the round runner with the reason these checks give. A run's summary counts the
reasons by cause (:func:`drop_cause`); ``metrics.jsonl`` keeps each reason whole.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from alignfl.core.model_io import array_values
from alignfl.plugins.options import is_number

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
        try:
            values = array_values(arrays[key])
        except (ValueError, TypeError) as error:
            return f"array '{key}' of '{name}' cannot be read: {error}"
        if not np.isfinite(values).all():  # numpy's one pass: ~10x torch.isfinite's on CPU
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


_FLOWER_ERROR = re.compile(r"^(.*?)<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>\s*$", re.DOTALL)
"""Flower's text for an exception a ClientApp or its backend raised: ``<class 'mod.Name'>:<'message'>``."""
_CLIENTAPP_PREFIX = re.compile(r"^\s*Exception ClientAppException occurred\. Message:\s*")
"""What Flower's Ray actor puts before the message of an exception raised inside the ClientApp."""
_PARTICULARS = (
    (re.compile(r"(?<![\w/.])/[^\s'\",;)\]]+"), "<path>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\[[0-9a-fA-F:]+\](?::\d+)?"), "<address>"),
    (re.compile(r"\b[0-9a-fA-F]{16,}\b"), "<id>"),
    (re.compile(r"'[^'\s]{1,80}'"), "'<name>'"),
    (re.compile(r"(?<!error code )(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?\b"), "<n>"),
)
"""What differs between two reports of one cause: paths, addresses, ids (a Ray node's), quoted names (a
key, a record), numbers (how many actors remain, a shape); an error code is kept."""


def drop_cause(reason: str) -> str:
    """The cause of a dropped client's reason: its first line with the particulars masked, so that one cause (a
    lost Ray node, a node lacking the data set) is counted once however many nodes, paths or actors it names.

    Examples
    --------
    >>> drop_cause("metric 'num-examples' must be a positive number, got -3")
    "metric '<name>' must be a positive number, got <n>"
    """
    text = reason
    wrapped = _FLOWER_ERROR.match(text)
    if wrapped is not None:
        before, name, message = wrapped.groups()
        message = _CLIENTAPP_PREFIX.sub("", message)
        text = before + (message if name == "ClientAppException" else f"{name}: {message}")
    text = next((line.strip() for line in text.splitlines() if line.strip()), "")
    for pattern, mask in _PARTICULARS:
        text = pattern.sub(mask, text)
    return text
