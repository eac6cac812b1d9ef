"""The launcher's parsing of `--run-config` strings (the parts that need no SuperLink)."""

import pytest

from fl_app.config import ConfigError
from fl_app.launch import parse_overrides, prepare_config, to_toml_pairs


def test_overrides_parse_toml_values_and_quoted_strings():
    parsed = parse_overrides('num-server-rounds=5 lr=0.1 strategy="fedprox" run-name="a b"')
    assert parsed == {"num-server-rounds": 5, "lr": 0.1, "strategy": "fedprox", "run-name": "a b"}


def test_round_trip_through_toml_pairs():
    values = {"num-server-rounds": 5, "lr": 0.1, "strategy": "fedprox", "results-dir": "/tmp/x y"}
    assert parse_overrides(to_toml_pairs(values)) == values


def test_malformed_override_is_refused():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides("num-server-rounds")


def test_min_available_nodes_defaults_to_all_and_cannot_exceed_them(tmp_path):
    config = prepare_config({"dataset": "digits", "results-dir": str(tmp_path)}, num_supernodes=7)
    assert config.min_available_nodes == 7 and config.run_name
    with pytest.raises(ConfigError, match="min-available-nodes"):
        prepare_config({"dataset": "digits", "min-available-nodes": 9}, num_supernodes=3)


def test_infeasible_partition_is_refused_before_starting(tmp_path):
    with pytest.raises(ValueError, match="dirichlet-alpha"):
        prepare_config({"dataset": "digits", "dirichlet-alpha": 0.01, "results-dir": str(tmp_path)}, num_supernodes=200)
