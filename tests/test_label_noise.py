"""Label noise: pair and symmetric flips at exactly the rate, deterministic per partition, on training labels only;
bad SuPerFed and noise values refused."""

from __future__ import annotations

import pytest
import torch

from alignfl.core.config import RunConfig
from alignfl.core.data.label_noise import noisy_labels
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import ConfigError, parse_run_config


@pytest.mark.parametrize("kind", ["pair", "symmetric"])
def test_label_noise_flips_exactly_the_rate_by_its_rule_deterministically(kind):
    labels = torch.arange(200) % 10
    noisy = noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=1)
    flipped = noisy != labels
    assert int(flipped.sum()) == 80
    if kind == "pair":
        assert torch.equal(noisy[flipped], (labels[flipped] + 1) % 10)
    else:
        assert len(set(((noisy[flipped] - labels[flipped]) % 10).tolist())) > 3  # spread over other classes
    assert torch.equal(noisy, noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=1))
    assert not torch.equal(noisy, noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=2))
    assert torch.equal(noisy_labels(labels, 10, "none", 0.4, 3, 1), labels)


def test_label_noise_reaches_training_labels_only():
    clean = client_data(RunConfig(dataset="digits", partitioner="iid"), 0, 3)
    noisy = client_data(
        RunConfig(dataset="digits", partitioner="iid", label_noise="symmetric", label_noise_rate=0.2), 0, 3
    )
    assert torch.equal(clean.test_y, noisy.test_y) and torch.equal(clean.train_x, noisy.train_x)
    assert int((clean.train_y != noisy.train_y).sum()) == round(0.2 * len(clean.train_y))


def test_config_refuses_bad_superfed_and_noise_values():
    for key, value in [
        ("superfed-mode", "xx"),
        ("superfed-nu", -1.0),
        ("superfed-start", 1.5),
        ("superfed-val-fraction", 1.0),
        ("label-noise", "flip"),
        ("label-noise-rate", 1.0),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            parse_run_config({key: value})
