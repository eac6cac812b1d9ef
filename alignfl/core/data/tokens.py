"""A synthetic token task for the one-block transformer, generated here (no files, no network).

``majority-tokens``: a sequence of :data:`LENGTH` tokens drawn uniformly from a
vocabulary of :data:`VOCABULARY`; the label is the sequence's most frequent
token. Only sequences with a unique most frequent token are kept, so every
label is well defined; the margin is often a single occurrence, so the model
must count exactly. Class frequencies are equal in expectation (the task is
symmetric in the tokens), so the usual label-skew partitioners apply.

Tokens are stored one-hot as ``(1, LENGTH, VOCABULARY)`` float "images": one
row per token, which is how :class:`alignfl.models.transformer.Transformer1` reads any
input (a linear embedding of a one-hot row is an embedding-table lookup). The
other networks also run on it (an MLP sees a bag of positions). Seeded, so
every process generates the same data.
"""

from __future__ import annotations

import numpy as np
import torch

LENGTH = 16
VOCABULARY = 10
TRAIN_SIZE = 6_000
TEST_SIZE = 2_000
SEED = 0


def majority_sequences(count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` token sequences (``count x LENGTH`` ints) with a unique most frequent token, and that token."""
    kept_tokens, kept_labels, total = [], [], 0
    while total < count:
        tokens = rng.integers(0, VOCABULARY, size=(2 * count, LENGTH))
        counts = np.stack([(tokens == v).sum(axis=1) for v in range(VOCABULARY)], axis=1)
        top = counts.max(axis=1, keepdims=True)
        unique = (counts == top).sum(axis=1) == 1
        kept_tokens.append(tokens[unique])
        kept_labels.append(counts[unique].argmax(axis=1))
        total += int(unique.sum())
    return np.concatenate(kept_tokens)[:count], np.concatenate(kept_labels)[:count]


def one_hot(tokens: np.ndarray) -> torch.Tensor:
    """``N x LENGTH`` token ids as ``N x 1 x LENGTH x VOCABULARY`` float32 one-hot rows."""
    return torch.nn.functional.one_hot(torch.from_numpy(tokens).long(), VOCABULARY).float().unsqueeze(1)


def majority_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)`` of the ``majority-tokens`` task, always the same."""
    rng = np.random.default_rng(SEED)
    train_tokens, train_y = majority_sequences(TRAIN_SIZE, rng)
    test_tokens, test_y = majority_sequences(TEST_SIZE, rng)
    return (
        one_hot(train_tokens),
        torch.from_numpy(train_y).long(),
        one_hot(test_tokens),
        torch.from_numpy(test_y).long(),
    )
