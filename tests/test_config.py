"""The run-config schema: composed from the parts that own the keys, defaults written once, every refusal names
the key and what is allowed, and a model that does not fit the algorithm is refused before anything starts."""

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from alignfl.core.config import RunConfig
from alignfl.core.data import list_datasets
from alignfl.core.partitioning.partitioners import PARTITIONERS, list_partitioners
from alignfl.fl_app.config import (
    ConfigError,
    check_run,
    default_run_config,
    keys_markdown,
    methods_markdown,
    names_markdown,
    owned_settings,
    parse_run_config,
    pyproject_problem,
    pyproject_table,
    tables,
    validate_run,
)
from alignfl.fl_app.config.__main__ import main as config_command
from alignfl.models import list_models
from alignfl.models.registry import model_options
from alignfl.plugins.options import key_of
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.fedprox import FedProxSettings

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_is_generated_from_the_settings_classes():
    """`python -m alignfl.fl_app.config --write` regenerates it; run it after changing a setting."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pyproject_table() in pyproject
    assert tomllib.loads(pyproject)["tool"]["flwr"]["app"]["config"] == default_run_config()


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda text: text.replace("\nseed = 0\n", "\n"), "it lacks 'seed'"),
        (lambda text: text.replace("\nseed = 0\n", "\nseed = 3\n"), "'seed' (3, declared 0)"),
        (
            lambda text: text.replace("[tool.flwr.app.config]\n", "[tool.flwr.app.config]\nretired = 1\n"),
            "['retired'] that no setting declares",
        ),
    ],
)
def test_a_stale_pyproject_table_is_refused_naming_the_keys_and_the_command(tmp_path, monkeypatch, edit, fragment):
    """Every entry point validates with :func:`validate_run` (the launcher, deploy and sweep exit 2, see
    tests/test_toy_algorithm.py); the shipped table passes."""
    assert pyproject_problem() is None
    stale = tmp_path / "pyproject.toml"
    stale.write_text(edit((ROOT / "pyproject.toml").read_text()))
    monkeypatch.setattr(tables, "PYPROJECT", stale)
    problem = pyproject_problem()
    assert problem is not None and fragment in problem and "python -m alignfl.fl_app.config --write" in problem
    with pytest.raises(ConfigError, match="Regenerate it"):
        validate_run(parse_run_config({"results-dir": str(tmp_path)}))


def test_the_configuration_page_holds_the_generated_key_tables_and_names():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert f"{tables.KEYS.begin}\n{keys_markdown()}{tables.KEYS.end}" in page
    assert f"{tables.NAMES.begin}\n{names_markdown()}{tables.NAMES.end}" in page
    assert all(f"`{name}`" in names_markdown() for name in list_strategies() + list_models() + list_datasets())


def test_the_readme_method_table_is_generated_from_the_registry():
    """One row per registered algorithm, with its summary and paper: a new algorithm needs no prose edit."""
    readme = (ROOT / "README.md").read_text()
    assert f"{tables.METHODS.begin}\n{methods_markdown()}{tables.METHODS.end}" in readme
    for name in list_strategies():
        algorithm = get_strategy(name)
        assert f"| `{name}` | {algorithm.summary} | {algorithm.paper} |" in methods_markdown()
        assert algorithm.paper, f"strategy '{name}' names no paper"


def test_the_regenerating_command_checks_and_writes_a_copy_of_the_project(tmp_path, capsys):
    """`python -m alignfl.fl_app.config --check` says which generated file is stale; `--write --root` rewrites a
    copy. In this process: the command line itself runs in tests/test_toy_algorithm.py's copy of the project."""
    for name in ("pyproject.toml", "README.md", "docs/configuration.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(page.read_text().replace("| `moon-mu` |", "| `moon-mu (stale)` |"))
    root = ["--root", str(tmp_path)]
    assert config_command([*root, "--check"]) == 1
    stale = capsys.readouterr().err
    assert "docs/configuration.md is stale" in stale
    assert "README.md" not in stale and "pyproject.toml" not in stale
    assert config_command([*root, "--write"]) == 0
    written = capsys.readouterr().out
    assert "docs/configuration.md updated" in written and "README.md already current" in written
    assert page.read_text() == (ROOT / "docs" / "configuration.md").read_text()
    assert config_command([*root, "--check"]) == 0


def test_a_missing_marker_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="lacks the markers <!-- methods: generated"):
        tables.render("# a README without the table\n", (tables.METHODS,), "README.md")


def test_import_layers_are_kept():
    """models <- core <- strategies <- apps, and the wings of fl_app and core in their order (import-linter)."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_empty_config_gives_defaults():
    assert parse_run_config({}) == RunConfig()


def test_every_key_of_an_algorithm_lives_in_its_settings():
    config = parse_run_config({"strategy": "fedprox", "fedprox-mu": 0.5})
    assert config.settings == FedProxSettings(fedprox_mu=0.5)
    assert config.to_run_config()["fedprox-mu"] == 0.5
    assert "fedprox-mu" not in parse_run_config({}).to_run_config()


def test_shared_keys_have_one_default_and_name_every_owner():
    owned = owned_settings()
    assert set(owned["bbp-sigma"].owners) == {"fedma"}
    assert {"psi-vgg9", "psi-vgg11", "psi-mobilenet"} <= set(owned["psi-groups"].owners)


def test_a_key_of_another_algorithm_is_accepted_at_its_default_and_refused_when_set():
    """`flwr run` passes every key of pyproject.toml along, so only what the user changed can be told apart."""
    assert parse_run_config({**default_run_config(), "strategy": "fedavg"}).strategy == "fedavg"
    with pytest.raises(
        ConfigError, match="'fedprox-mu' = 0.1 belongs to strategy 'fedprox', not to the chosen strategy 'fedavg'"
    ):
        parse_run_config({"fedprox-mu": 0.1})
    with pytest.raises(
        ConfigError, match="'psi-groups' = 3 belongs to model .*'psi-vgg9'.*not to the chosen model 'mlp'"
    ):
        parse_run_config({"psi-groups": 3})
    with pytest.raises(
        ConfigError,
        match="'classes-per-client' = 3 belongs to partitioner 'pathological', not to the "
        "chosen partitioner 'dirichlet'",
    ):
        parse_run_config({"classes-per-client": 3})
    assert (
        parse_run_config(
            {"partitioner": "pathological", "classes-per-client": 3, "dirichlet-alpha": 0.5}
        ).partitioner_settings.classes_per_client
        == 3
    )  # at its default


def test_values_are_coerced_and_kept():
    config = parse_run_config({"lr": 1, "num-server-rounds": 3.0, "strategy": "fedprox", "dirichlet-alpha": 0.1})
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.num_server_rounds == 3 and isinstance(config.num_server_rounds, int)
    assert config.strategy == "fedprox" and config.partitioner_settings.dirichlet_alpha == 0.1


@pytest.mark.parametrize(
    ("values", "key", "value", "fragment"),
    [
        ({}, "strategy", "fedfoo", "fedavg"),
        ({}, "model", "nope", "mlp"),
        ({}, "dataset", "imagenet", "'digits', 'fashion-mnist'"),
        ({}, "mlflow-uri", "bogus://nowhere", "'sqlite'"),
        ({}, "mlflow-uri", "sqlite:///relative.db", "sqlite:////absolute/path.db"),
        ({}, "mlflow-uri", "nowhere", "'http'"),
        ({}, "partitioner", "zipf", "dirichlet"),
        ({}, "dirichlet-alpha", 0.0, "> 0"),
        ({}, "dirichlet-alpha", -1.0, "> 0"),
        ({}, "fraction-train", 0.0, "(0, 1]"),
        ({}, "fraction-train", 1.5, "(0, 1]"),
        ({}, "fraction-evaluate", -0.1, "(0, 1]"),
        ({}, "num-server-rounds", 0, "positive"),
        ({}, "local-epochs", -1, "positive"),
        ({}, "batch-size", 0, "positive"),
        ({}, "server-evaluate-every", 0, "positive"),
        ({}, "server-evaluate-every", -1, "positive"),
        ({}, "server-evaluate-every", "x", "type int"),
        ({"partitioner": "pathological"}, "classes-per-client", 11, "number of classes"),
        ({"partitioner": "pathological"}, "classes-per-client", 0, "positive"),
        ({"partitioner": "shard"}, "shards-per-client", 0, "positive"),
        ({"partitioner": "fixed-pairs"}, "samples-per-client", 3, "even"),
        ({}, "lr", 0.0, "> 0"),
        ({}, "lr", -0.05, "> 0"),
        ({}, "momentum", 1.0, "[0, 1)"),
        ({}, "test-fraction", 1.0, "(0, 1)"),
        ({}, "results-dir", "relative/path", "absolute"),
        ({}, "data-root", "data", "absolute"),
        ({}, "device", "tpu", "cuda"),
        ({}, "seed", -3, ">= 0"),
        ({}, "node-wait-timeout", 0.0, "> 0"),
        ({}, "num-server-rounds", "ten", "type int"),
        ({}, "lr", "fast", "type float"),
        ({"strategy": "fedprox"}, "fedprox-mu", -1.0, ">= 0"),
        ({"strategy": "superfed"}, "superfed-mode", "xx", "mm"),
        ({"strategy": "matched"}, "matched-cost", "cosine", "weight"),
        ({"model": "vgg9"}, "width-factor", 0.0, "> 0"),
    ],
)
def test_bad_values_are_refused_with_key_and_allowed(values, key, value, fragment):
    with pytest.raises(ConfigError) as error:
        parse_run_config({**values, key: value})
    message = str(error.value)
    assert f"'{key}'" in message and repr(value) in message and fragment in message


FORM_KEYS = {"results-dir", "resume-from", "data-root", "mlflow-uri", "device", "client-widths"}
"""The string keys whose refusals describe a form (a path, a URI, ``cuda:<index>``, a list of numbers) rather than list names."""


def declared_choices(key: str) -> list[str] | None:
    """The names a key's ``choice(...)`` field takes, wherever it is declared; None for another field."""
    fields = [*dataclasses.fields(RunConfig)] + [
        f
        for kind, names, lookup in (
            ("strategy", list_strategies(), lambda name: get_strategy(name).settings),
            ("model", list_models(), model_options),
            ("partitioner", list_partitioners(), lambda name: PARTITIONERS.get(name).settings),
        )
        for name in names
        for f in dataclasses.fields(lookup(name))
    ]
    found = {
        tuple(sorted(f.metadata["choices"].names()))
        for f in fields
        if key_of(None, f.name) == key and "choices" in f.metadata
    }
    assert len(found) <= 1, (key, found)
    return list(next(iter(found))) if found else None


def test_every_choice_key_lists_every_value_it_takes():
    """Every string key that refuses an unknown word lists what it takes, or is a form key (a path, a URI)."""
    owned = owned_settings()
    registries = {"strategy": list_strategies(), "model": list_models()}  # chosen before the schema is composed
    listed = 0
    for key, default in default_run_config().items():
        if not isinstance(default, str):
            continue
        chooser = {owned[key].kind: owned[key].owners[0]} if key in owned else {}
        try:
            parse_run_config({**chooser, key: "no-such-value"})
            continue  # free text (run-name)
        except ConfigError as error:
            message = str(error)
        names = declared_choices(key) or registries.get(key)
        if key in FORM_KEYS:
            assert names is None, key
            continue
        assert names, f"'{key}' refuses a word but is no choice(...) field: {message}"
        assert all(repr(name) in message for name in names), (key, message)
        listed += 1
    assert listed >= 14


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match="unknown run-config key.*'dirichlet_alpha'.*dirichlet-alpha"):
        parse_run_config({"dirichlet_alpha": 0.3})


def test_replace_validates():
    config = RunConfig().replace(num_server_rounds=4)
    assert config.num_server_rounds == 4
    with pytest.raises(ConfigError, match="num-server-rounds"):
        RunConfig().replace(num_server_rounds=0)


def _fits(strategy: str, model: str) -> bool:
    try:
        check_run(parse_run_config({"strategy": strategy, "model": model, "dataset": "digits"}))
    except ConfigError:
        return False
    return True


def test_models_that_do_not_fit_the_algorithm_are_refused_naming_both():
    with pytest.raises(ConfigError, match="'model' = 'mlp' is not allowed with strategy 'psinet'"):
        check_run(parse_run_config({"strategy": "psinet", "model": "mlp"}))
    with pytest.raises(ConfigError, match="psi-depth must be an int in"):
        check_run(parse_run_config({"model": "psi-vgg9", "psi-depth": 99, "dataset": "digits"}))
    with pytest.raises(ConfigError, match="psi-groups"):
        check_run(parse_run_config({"model": "psi-vgg9", "psi-groups": 11, "dataset": "digits"}))


def test_which_pairs_fit_is_decided_by_the_model_itself():
    """Ψ-Net averaging needs a grouped net; matching needs a permutation description, which every model has."""
    assert not _fits("psinet", "mlp") and _fits("psinet", "psi-vgg9") and _fits("psinet", "psi-mobilenet")
    assert all(_fits("matched", model) for model in list_models())
    assert all(_fits(name, "small-mlp") for name in list_strategies() if name != "psinet")


@pytest.mark.parametrize(("key", "path"), [("results-dir", "/proc/alignfl"), ("data-root", "/nonexistent/data")])
def test_unusable_folders_are_refused_before_anything_starts(key, path):
    with pytest.raises(ConfigError, match=f"'{key}' = '{path}'"):
        validate_run(parse_run_config({key: path}))
