"""Key names: an algorithm's own run-config keys carry its name, a settings family's keep the family's prefix,
registration refuses a key that breaks the rule, and a renamed key is still read under its old name (run configs,
run folders, checkpoints) with a warning naming the new one."""

import json
from dataclasses import dataclass

import pytest
import torch

from alignfl.core.merging.bbp import BBPSettings
from alignfl.core.rounds.strategy import ServerStep, ServerStrategy
from alignfl.fl_app.checkpoint import CHECKPOINT
from alignfl.fl_app.config import ConfigError, default_run_config, parse_run_config, rename_old_keys
from alignfl.fl_app.inprocess import run_in_process
from alignfl.plugins.options import option, option_from, prefix_problems, settings_fields
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import Algorithm

RENAMED = [(name, old, new) for name in list_strategies() for old, new in get_strategy(name).renamed.items()]


@pytest.mark.parametrize("name", list_strategies())
def test_every_registered_algorithm_keeps_the_rule(name):
    settings = get_strategy(name).settings
    assert prefix_problems(name, settings) == []
    assert all(s.key.startswith((f"{name}-", "bbp-")) for s in settings_fields(settings))


@dataclass(frozen=True)
class BareKey:
    trim: float = option(0.1, "share of each coordinate's extremes left out", lambda v: 0 <= v < 0.5, "in [0, 0.5)")


@dataclass(frozen=True)
class RenamedFamilyKey:
    median_sigma: float = option_from(BBPSettings, "sigma")


@dataclass(frozen=True)
class SharedDeclaration:
    median_server_lr: float = option_from(ServerStep, "server_lr")


def test_registration_refuses_a_key_without_the_algorithm_s_prefix_naming_key_and_prefix():
    with pytest.raises(ValueError, match="strategy 'median': key 'trim' of BareKey must start with 'median-'"):
        Algorithm("median", ServerStrategy, LocalUpdate, "coordinate-wise median", BareKey)


def test_a_settings_family_s_key_keeps_the_family_s_name_wherever_it_is_borrowed():
    with pytest.raises(ValueError, match="key 'median-sigma' borrows BBPSettings.sigma, whose key is 'bbp-sigma'"):
        Algorithm("median", ServerStrategy, LocalUpdate, "coordinate-wise median", RenamedFamilyKey)


def test_a_shared_declaration_is_borrowed_under_the_algorithm_s_own_prefix():
    algorithm = Algorithm("median", ServerStrategy, LocalUpdate, "coordinate-wise median", SharedDeclaration)
    (setting,) = settings_fields(algorithm.settings)
    assert (setting.key, setting.default) == ("median-server-lr", 1.0)


def test_a_renamed_key_must_name_one_of_the_algorithm_s_keys():
    with pytest.raises(ValueError, match="renamed key 'lr' -> 'median-lr'"):
        Algorithm("median", ServerStrategy, LocalUpdate, "median", SharedDeclaration, renamed={"lr": "median-lr"})


@pytest.mark.parametrize(("name", "old", "new"), RENAMED)
def test_an_old_key_is_read_with_a_warning_naming_the_new_one(name, old, new):
    value = default_run_config()[new]
    changed = {float: 0.5, int: 2, str: "iterative" if "reference" in new else "l1"}[type(value)]
    with pytest.warns(FutureWarning, match=f"run-config key '{old}' is now '{new}'"):
        config = parse_run_config({**default_run_config(), "strategy": name, old: changed})
    assert config.to_run_config()[new] == changed and old not in config.to_run_config()


def test_an_old_key_shared_by_two_algorithms_takes_the_chosen_one_s_name():
    with pytest.warns(FutureWarning):
        assert rename_old_keys({"strategy": "scaffold", "server-lr": 0.5}) == {
            "strategy": "scaffold",
            "scaffold-server-lr": 0.5,
        }
        assert "fedavgm-server-lr" in rename_old_keys({"strategy": "fedavgm", "server-lr": 0.5})


def test_an_old_key_of_an_algorithm_not_chosen_is_refused_when_set_naming_the_new_key():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="'fedprox-mu' = 0.5 belongs to strategy"):
        parse_run_config({"strategy": "fedavg", "proximal-mu": 0.5})


def test_old_and_new_names_set_to_different_values_are_refused():
    with pytest.raises(ConfigError, match="'proximal-mu' is the old name of 'fedprox-mu'; set 'fedprox-mu' only"):
        parse_run_config({"strategy": "fedprox", "proximal-mu": 0.5, "fedprox-mu": 0.1})
    with pytest.warns(FutureWarning):  # the new key at its default, as pyproject.toml passes it: the old one wins
        config = parse_run_config({**default_run_config(), "strategy": "fedprox", "proximal-mu": 0.5})
    assert config.settings.fedprox_mu == 0.5


def test_a_checkpoint_written_under_old_key_names_resumes(tmp_path):
    """A checkpoint (and config.json) from before the rename stores ``server-momentum``; ``resume-from`` takes it,
    and a changed value is still refused under the new name."""
    common = {"dataset": "digits", "model": "small-mlp", "device": "cpu", "results-dir": str(tmp_path)}
    fedavgm = {"strategy": "fedavgm", "fedavgm-server-momentum": 0.5}
    run_in_process({**common, **fedavgm, "num-server-rounds": 1, "run-name": "old"}, 2)
    path = tmp_path / "old" / CHECKPOINT
    payload = torch.load(path, weights_only=True)
    payload["config"] = {
        {"fedavgm-server-momentum": "server-momentum", "fedavgm-server-lr": "server-lr"}.get(key, key): value
        for key, value in payload["config"].items()
    }
    assert payload["config"]["server-momentum"] == 0.5
    torch.save(payload, path)
    resume = {**common, "resume-from": str(tmp_path / "old"), "num-server-rounds": 2}
    with pytest.raises(ConfigError, match="'fedavgm-server-momentum': checkpoint 0.5, now 0.9"):
        run_in_process({**resume, "strategy": "fedavgm"}, 2)
    with pytest.warns(FutureWarning, match="'server-momentum' is now 'fedavgm-server-momentum'"):
        run_in_process({**resume, **fedavgm}, 2)
    rounds = [json.loads(line)["round"] for line in (tmp_path / "old" / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2]
