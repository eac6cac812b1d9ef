"""The launcher's parsing of `--run-config` strings (the parts that need no SuperLink)."""

import pytest

from fl_app.config import ConfigError
from fl_app import launch
from fl_app.launch import check_client_resources, parse_overrides, prepare_config, to_toml_pairs


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


@pytest.mark.parametrize(("cpus", "gpus", "cuda", "fragment"), [
    (0, 0.0, False, "--num-cpus=0"),
    (1, -0.5, True, "--num-gpus=-0.5"),
    (1, 1.5, True, "whole GPUs"),
    (1, 0.25, False, "no CUDA device"),
])
def test_unschedulable_client_resources_are_refused(cpus, gpus, cuda, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_client_resources(cpus, gpus, cuda)


def test_fractional_and_whole_gpus_are_accepted_where_cuda_is():
    for gpus in (0.0, 0.25, 1.0, 2.0):
        check_client_resources(1, gpus, cuda_available=True)
    check_client_resources(2, 0.0, cuda_available=False)


def test_launcher_refuses_gpus_without_cuda_before_starting(monkeypatch, capsys):
    monkeypatch.setattr(launch, "torch_cuda_available", lambda: False)
    monkeypatch.setattr(launch, "local_superlink", None)  # starting one would fail loudly
    assert launch.main(["--num-gpus", "0.25", "--run-config", 'dataset="digits"']) == 2
    assert "--num-gpus=0.25" in capsys.readouterr().err
