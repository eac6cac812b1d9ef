"""Settings declared once (alignfl/plugins/options.py): run-config sections that carry a lower layer's settings borrow
its fields (``option_from``), so the run config and the engine cannot disagree on a default, a help text or a
check; and the engine's own settings objects check their fields with the same checks."""

from __future__ import annotations

import dataclasses

import pytest

from alignfl.core.config import SECTIONS, PanSection, RunConfig
from alignfl.core.merging.bbp import BBPSettings
from alignfl.fl_app.config import ConfigError, parse_run_config
from alignfl.models import PanSettings, list_models
from alignfl.models.registry import model_options
from alignfl.plugins.options import check_fields, option, option_from, settings_fields, source_settings
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.fedma import FedMASettings


def _run_config_classes() -> list[type]:
    """Every settings class whose fields are run-config keys: the common sections, every algorithm's, every
    model's."""
    return [
        *SECTIONS.values(),
        *(get_strategy(name).settings for name in list_strategies()),
        *(model_options(name) for name in list_models()),
    ]


def _borrowed(settings: type) -> list[tuple[dataclasses.Field, dataclasses.Field]]:
    """(run-config field, the source field it borrows) for each ``option_from`` field of ``settings``."""
    pairs = []
    for field in dataclasses.fields(settings):
        if "source" in field.metadata:
            source, name = field.metadata["source"]
            pairs.append((field, next(f for f in dataclasses.fields(source) if f.name == name)))
    return pairs


def test_borrowed_fields_are_their_sources_field_for_field():
    """Default, help, check, allowed values and type of every borrowed run-config field are its source's."""
    seen = set()
    for settings in _run_config_classes():
        kinds = {s.name: s.kind for s in settings_fields(settings)}
        for field, source in _borrowed(settings):
            source_class = field.metadata["source"][0]
            seen.add((source_class.__name__, source.name))
            assert field.default == source.default, field.name
            for item in ("help", "check", "allowed"):
                assert field.metadata[item] is source.metadata[item], (field.name, item)
            assert kinds[field.name] is next(s.kind for s in settings_fields(source_class) if s.name == source.name)
    # Every PAN setting and every BBP-MAP setting but the merge tool's `estimate` has a run-config key.
    assert {name for cls, name in seen if cls == "PanSettings"} == {f.name for f in dataclasses.fields(PanSettings)}
    assert {name for cls, name in seen if cls == "BBPSettings"} == {f.name for f in dataclasses.fields(BBPSettings)} - {
        "estimate"
    }


def test_the_engine_settings_are_the_run_configs_at_every_default_and_value():
    assert RunConfig().pan == PanSettings()
    assert parse_run_config({}).pan == PanSettings()
    assert FedMASettings().bbp() == BBPSettings()
    run = parse_run_config({"pan-mode": "add", "pan-t": 2.0, "pan-a": 0.3})
    assert run.pan == PanSettings(mode="add", period=2.0, amplitude=0.3)
    assert run.pan_signature() == {"pan-mode": "add", "pan-t": 2.0, "pan-a": 0.3}
    values = {
        "bbp-sigma": 0.5,
        "bbp-sigma0": 2.0,
        "bbp-mu0": 0.1,
        "bbp-gamma": 3.0,
        "bbp-max-width": 9,
        "bbp-iterations": 2,
        "bbp-include-classifier": True,
    }
    bbp = parse_run_config({"strategy": "fedma", **values}).settings.bbp()
    assert bbp == BBPSettings(
        sigma=0.5, sigma0=2.0, mu0=0.1, gamma=3.0, max_width=9, iterations=2, include_classifier=True
    )


@pytest.mark.parametrize(
    ("key", "value", "engine", "field"),
    [
        ("pan-mode", "both", PanSettings, "mode"),
        ("pan-t", -1.0, PanSettings, "period"),
        ("pan-a", float("inf"), PanSettings, "amplitude"),
        ("bbp-sigma", 0.0, BBPSettings, "sigma"),
        ("bbp-mu0", float("nan"), BBPSettings, "mu0"),
        ("bbp-max-width", 0, BBPSettings, "max_width"),
        ("bbp-iterations", -1, BBPSettings, "iterations"),
    ],
)
def test_one_check_refuses_a_value_in_the_run_config_and_in_code(key, value, engine, field):
    """The run config names the key, the engine's object the field; both give the one declared reason."""
    allowed = next(f for f in dataclasses.fields(engine) if f.name == field).metadata["allowed"]
    with pytest.raises(ConfigError) as run_config:
        parse_run_config({"strategy": "fedma", key: value})
    assert str(run_config.value) == f"run-config key '{key}' = {value!r} is not allowed: {allowed}"
    with pytest.raises(ValueError) as in_code:
        engine(**{field: value})
    assert str(in_code.value) == f"{engine.__name__}.{field} = {value!r} is not allowed: {allowed}"


def test_pan_section_keys_and_help_are_unchanged():
    """What pyproject.toml and docs/configuration.md show for PANs (test_config checks those files against the classes)."""
    assert [(s.key, s.default, s.help) for s in settings_fields(PanSection)] == [
        ("pan-mode", "off", "off | add | mul"),
        ("pan-t", 1.0, "period T: sine periods across a layer's units"),
        ("pan-a", 0.0, "amplitude A"),
    ]


@dataclasses.dataclass(frozen=True)
class _Engine:
    rate: float = option(0.5, "a rate", lambda v: 0 < v < 1, "must lie in (0, 1)")
    steps: int = option(3, "steps", lambda v: v >= 1, "must be an integer >= 1")
    plain: str = "not an option"

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class _Section:
    engine_rate: float = option_from(_Engine, "rate")
    engine_steps: int = option_from(_Engine, "steps")


def test_option_from_and_source_settings_round_trip():
    assert [(s.key, s.default, s.help) for s in settings_fields(_Section)] == [
        ("engine-rate", 0.5, "a rate"),
        ("engine-steps", 3, "steps"),
    ]
    assert source_settings(_Section(0.25, 7), _Engine) == _Engine(rate=0.25, steps=7)
    with pytest.raises(ValueError, match="_Engine has no option 'plain'"):
        option_from(_Engine, "plain")
    with pytest.raises(ValueError, match="_Engine has no option 'missing'"):
        option_from(_Engine, "missing")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 1.5}, "_Engine.rate = 1.5 is not allowed: must lie in (0, 1)"),
        ({"steps": 2.0}, "_Engine.steps = 2.0 is not allowed: must be of type int"),
        ({"steps": True}, "_Engine.steps = True is not allowed: must be of type int"),
        ({"rate": "0.5"}, "_Engine.rate = '0.5' is not allowed: must be of type float"),
    ],
)
def test_check_fields_names_the_field_its_type_and_its_check(kwargs, message):
    with pytest.raises(ValueError) as error:
        _Engine(**kwargs)
    assert str(error.value) == message


def test_check_fields_lets_an_int_stand_for_a_float():
    assert PanSettings(period=2).period == 2
