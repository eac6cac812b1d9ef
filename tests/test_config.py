"""The run-config schema: defaults in one place, and every refusal names the key and what is allowed."""

import tomllib
from pathlib import Path

import pytest

from fl_app.config import ConfigError, RunConfig, default_run_config, parse_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_equal_schema_defaults():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == default_run_config()


def test_empty_config_gives_defaults():
    assert parse_run_config({}) == RunConfig()


def test_values_are_coerced_and_kept():
    config = parse_run_config({"lr": 1, "num-server-rounds": 3.0, "strategy": "fedprox", "dirichlet-alpha": 0.1})
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.num_server_rounds == 3 and isinstance(config.num_server_rounds, int)
    assert config.strategy == "fedprox" and config.dirichlet_alpha == 0.1


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("strategy", "fedfoo", "fedavg"),
        ("model", "nope", "mlp"),
        ("dataset", "imagenet", "fashion-mnist"),
        ("partitioner", "zipf", "dirichlet"),
        ("dirichlet-alpha", 0.0, "> 0"),
        ("dirichlet-alpha", -1.0, "> 0"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
        ("fraction-evaluate", -0.1, "(0, 1]"),
        ("num-server-rounds", 0, "positive"),
        ("local-epochs", -1, "positive"),
        ("batch-size", 0, "positive"),
        ("classes-per-client", 11, "number of classes"),
        ("lr", 0.0, "> 0"),
        ("momentum", 1.0, "< 1"),
        ("test-fraction", 1.0, "(0, 1)"),
        ("results-dir", "relative/path", "absolute"),
        ("data-root", "data", "absolute"),
        ("device", "tpu", "cuda"),
        ("seed", -3, ">= 0"),
        ("num-server-rounds", "ten", "type int"),
        ("lr", "fast", "type float"),
    ],
)
def test_bad_values_are_refused_with_key_and_allowed(key, value, fragment):
    with pytest.raises(ConfigError) as error:
        parse_run_config({key: value})
    message = str(error.value)
    assert f"'{key}'" in message and repr(value) in message and fragment in message


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match="unknown run-config key.*'dirichlet_alpha'.*dirichlet-alpha"):
        parse_run_config({"dirichlet_alpha": 0.3})


def test_replace_validates():
    config = RunConfig().replace(num_server_rounds=4)
    assert config.num_server_rounds == 4
    with pytest.raises(ConfigError, match="num-server-rounds"):
        RunConfig().replace(num_server_rounds=0)
