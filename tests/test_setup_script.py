"""scripts/pip_sources.py: pip's configured package sources, as the options ``uv pip install`` takes in setup.sh."""

import importlib.util
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""


_spec = importlib.util.spec_from_file_location("pip_sources", PROJECT_ROOT / "scripts" / "pip_sources.py")
pip_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_sources)


def test_every_configured_source_becomes_a_uv_option_once():
    listing = "\n".join(
        [
            "global.cert='/etc/ssl/certs/ca.crt'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
            "global.find-links='/opt/wheels'",
            ":env:.find-links='/opt/wheels'",
            ":env:.default-timeout='180'",
        ]
    )
    assert pip_sources.uv_options(listing) == [
        "--constraint",
        "/etc/pip/constraints.txt",
        "--extra-index-url",
        "file:///opt/a/simple",
        "--extra-index-url",
        "file:///opt/b/simple",
        "--find-links",
        "/opt/wheels",
    ]


def test_no_configuration_means_no_option():
    assert pip_sources.uv_options("") == []
