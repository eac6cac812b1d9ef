"""The analysis command line (python -m alignfl.fl_app.analysis): every tool documents itself, runs end to end on run
folders or fresh models and writes its JSON and plot, and refuses bad input, naming the value, before writing
anything."""

from __future__ import annotations

import json

import pytest
import torch

from alignfl.core.config import RESULTS_ENV
from alignfl.core.data import load_dataset
from alignfl.core.model_io import federated_state
from alignfl.fl_app.analysis import (
    weight_divergence,
)
from alignfl.fl_app.analysis.__main__ import SUBCOMMANDS, main
from alignfl.fl_app.analysis.common import check_out_dir
from alignfl.fl_app.config import parse_run_config
from alignfl.models import build_model
from tests.analysis_models import DIGITS


def _run_folder(path, model: str = "small-mlp", seed: int = 0, **keys):
    """A run folder as a training run leaves it: config.json and model.pt (federated state)."""
    run_config = parse_run_config({"dataset": "digits", "model": model, "seed": seed, **keys})
    torch.manual_seed(seed)
    net = build_model(model, DIGITS, 10, run_config.pan)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(run_config.to_run_config()))
    torch.save(federated_state(net), path / "model.pt")
    return path


@pytest.fixture
def runs(tmp_path):
    pan = {"pan-mode": "mul", "pan-a": 0.1}
    return _run_folder(tmp_path / "run-a", **pan), _run_folder(tmp_path / "run-b", seed=1, **pan)


@pytest.mark.parametrize("tool", sorted(SUBCOMMANDS))
def test_every_tool_documents_itself(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([tool, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: python -m alignfl.fl_app.analysis {tool}" in text and "--out" in text


def _end_to_end(argv: list[str], out, capsys) -> dict:
    assert main([*argv, "--out", str(out)]) == 0
    name = argv[0]
    assert (out / f"{name}.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert f"wrote {out / f'{name}.json'}" in printed
    return json.loads((out / f"{name}.json").read_text())


def test_cli_shuffle_test_sweep(tmp_path, capsys):
    result = _end_to_end(
        [
            "shuffle-test",
            "--model",
            "small-mlp",
            "--dataset",
            "digits",
            "--p-sf",
            "0",
            "1",
            "--amplitudes",
            "0",
            "0.5",
            "--repeats",
            "1",
            "--batch",
            "8",
        ],
        tmp_path / "sweep",
        capsys,
    )
    points = {(p["mode"], p["amplitude"], p["p_sf"]): p for p in result["results"]}
    assert len(points) == 2 * 2 * 2
    assert points["mul", 0.5, 0.0]["error"] == 0.0 and points["mul", 0.5, 1.0]["error"] > 1e-4


def test_cli_shuffle_test_trained_run(runs, tmp_path, capsys):
    result = _end_to_end(
        ["shuffle-test", "--run", str(runs[0]), "--p-sf", "0", "0.5", "--repeats", "1", "--batch", "8"],
        tmp_path / "trained",
        capsys,
    )
    first, second = result["results"]
    assert first["accuracy_change"] == 0.0 and first["r_kept"] == 1.0
    assert second["error"] > 0 and result["pan"] == {"mode": "mul", "period": 1.0, "amplitude": 0.1}


def test_cli_weight_divergence(runs, tmp_path, capsys):
    bare = tmp_path / "bare.pt"  # a model file without config.json: weights are all this tool reads
    bare.write_bytes((runs[1] / "model.pt").read_bytes())
    result = _end_to_end(
        ["weight-divergence", str(runs[0]), str(bare), "--weights", "1", "3"], tmp_path / "div", capsys
    )
    states = [torch.load(run / "model.pt") for run in runs]
    assert result["per_key"] == pytest.approx(weight_divergence(states, [1, 3]))
    assert list(result["per_layer"]) == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "classifier"]


def test_cli_weight_divergence_refuses_models_of_other_networks(runs, tmp_path, capsys):
    other = _run_folder(tmp_path / "run-twonn", model="twonn")
    out = tmp_path / "div"
    assert main(["weight-divergence", str(runs[0]), str(other), "--out", str(out)]) == 2
    assert "state 1 differs from state 0: missing keys" in capsys.readouterr().err
    assert not out.exists()


def test_cli_matching_ratio(runs, tmp_path, capsys):
    result = _end_to_end(
        ["matching-ratio", "--global-model", str(runs[0]), "--local-model", str(runs[0]), "--samples", "100"],
        tmp_path / "match",
        capsys,
    )
    assert result["samples"] == 100
    assert all(group["ratio"] == 1.0 for group in result["groups"].values())
    shuffled = _end_to_end(
        ["matching-ratio", "--model", "small-mlp", "--dataset", "digits", "--p-sf", "0.5"], tmp_path / "self", capsys
    )
    assert shuffled["samples"] == len(load_dataset("digits").test_y)  # 500 asked, capped at the test split
    for group, match in shuffled["groups"].items():
        if match["inactive"] == 0:
            assert match["ratio"] == pytest.approx(shuffled["shuffle_r_kept"][group])


def test_cli_preference_vectors(runs, tmp_path, capsys):
    result = _end_to_end(
        [
            "preference-vectors",
            "--model-a",
            str(runs[0]),
            "--model-b",
            str(runs[0]),
            "--samples-per-class",
            "10",
            "--layer",
            "hidden.1",
        ],
        tmp_path / "pref",
        capsys,
    )
    assert all(c["agreement"] == 1.0 for c in result["comparison"].values())
    assert len(result["preferences"]["a"]["hidden.1"]) == 100 and len(result["preferences"]["a"]["hidden.1"][0]) == 10


@pytest.mark.parametrize(
    "argv, message",
    [
        (["shuffle-test", "--run", "/nonexistent/run"], "'/nonexistent/run' does not exist"),
        (["shuffle-test", "--model", "resnet99"], "--model 'resnet99' is not known; allowed: ["),
        (["shuffle-test", "--model", "small-mlp", "--p-sf", "1.5"], "--p-sf must lie in [0, 1], got 1.5"),
        (
            ["shuffle-test", "--model", "small-mlp", "--modes", "sub"],
            "PAN mode 'sub' is not known; allowed: ['add', 'mul']",
        ),
        (["matching-ratio", "--model", "small-mlp", "--samples", "0"], "--samples must be a positive integer, got 0"),
        (["matching-ratio", "--model", "small-mlp", "--samples", "-5"], "got -5"),
        (["matching-ratio", "--model", "small-mlp", "--dataset", "imagenet"], "--dataset 'imagenet' is not known"),
        (["preference-vectors", "--model", "small-mlp", "--layer", "fc9"], "--layer 'fc9' is not a hidden group"),
        (["weight-divergence", "/nonexistent/a"], "at least 2 models, got 1"),
        (["weight-divergence", "/nonexistent/a", "/nonexistent/b"], "'/nonexistent/a' does not exist"),
    ],
)
def test_cli_bad_input_names_the_value_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_relative_output_folder(capsys):
    assert main(["shuffle-test", "--model", "small-mlp", "--out", "relative/out"]) == 2
    assert "--out must be an absolute path, got 'relative/out'" in capsys.readouterr().err


def test_cli_refuses_a_folder_without_model(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["matching-ratio", "--global-model", str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 2
    assert "model.pt' is missing" in capsys.readouterr().err


def test_a_tool_writes_under_the_results_root_of_every_run(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    assert check_out_dir(None, "merge").parent == tmp_path / "analysis"
