"""``python -m alignfl.fl_app.analysis merge``: one-shot merging of K locally trained models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from alignfl.core.data import ImageDataset, load_dataset
from alignfl.core.merging.bbp import BBPSettings
from alignfl.fl_app.analysis.__main__ import main
from alignfl.fl_app.analysis.common import AnalysisError
from alignfl.fl_app.analysis.merge import merge_accuracies, strategy_merge
from alignfl.fl_app.analysis.merge_options import MERGE_COSTS, UNIVERSE_COSTS, costs
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import parse_run_config
from alignfl.models import build_model, permute_state, random_permutations

DIGITS_MLP = parse_run_config({"dataset": "digits", "model": "small-mlp"})
"""The clients' settings the merges take (the strategies' seed)."""


def model_and_permuted_copy() -> tuple[ImageDataset, torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The digits, a small MLP, its state, and that state with every group's units randomly permuted."""
    digits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("small-mlp", (1, 8, 8), 10)
    spec, state = model.permutation_spec(), model.state_dict()
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    return digits, model, state, permuted


def test_a_model_merged_with_its_permuted_copy_scores_like_the_model():
    digits, model, state, permuted = model_and_permuted_copy()
    clients, merged, _ = merge_accuracies(
        DIGITS_MLP,
        model,
        [state, permuted],
        [1.0, 2.0],
        digits.test_x,
        digits.test_y,
        ["weight", "l1"],
        1,
        torch.device("cpu"),
    )
    assert clients[0] == clients[1]
    assert set(merged) == {"average", "matched-weight", "matched-l1", "ensemble"}
    assert merged["matched-weight"] == merged["matched-l1"] == merged["ensemble"] == clients[0]


def test_a_strategys_merge_takes_only_its_own_keys_and_refuses_anothers():
    digits, model, state, permuted = model_and_permuted_copy()
    clients = parse_run_config({"dataset": "digits", "model": "small-mlp", "strategy": "matched", "matched-cost": "l1"})
    merge = strategy_merge(clients, model, "fedavg", {}, [state, permuted], [1.0, 1.0], state)  # matched-cost left out
    assert merge.unit_maps is None and merge.metrics == {}
    with pytest.raises(AnalysisError, match="matched-cost"):
        strategy_merge(DIGITS_MLP, model, "otfusion", {"matched-cost": "l1"}, [state, permuted], [1.0, 1.0], state)


def test_the_command_trains_merges_and_writes_json_and_plot(tmp_path, capsys):
    code = main(["merge", "--clients", "2", "--epochs", "1", "--costs", "l1", "--init", "same", "--out", str(tmp_path)])
    assert code == 0
    payload = json.loads((tmp_path / "merge.json").read_text())
    assert (tmp_path / "merge.png").stat().st_size > 0
    config = parse_run_config({"dataset": "digits", "model": "small-mlp"})  # the command's defaults
    trained = [len(client_data(config, client, 2).train_y) for client in range(2)]  # each partition less its test split
    assert len(payload["client-accuracy"]) == 2 and payload["examples"] == trained
    assert set(payload["merged-accuracy"]) == {"average", "matched-l1", "ensemble"}
    assert all(0.0 <= acc <= 1.0 for acc in payload["client-accuracy"] + list(payload["merged-accuracy"].values()))
    assert "matched-l1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--clients", "1"], "--clients must be at least 2"),
        (["--init", "twin"], "--init 'twin'"),
        (["--costs", "cosine"], "--costs 'cosine'"),
        (["--dirichlet-alpha", "-1"], "--dirichlet-alpha -1.0 is not allowed: must be > 0"),
        (["--model", "vgg99"], "--model 'vgg99' is not allowed: choose one of"),
        (["--epochs", "0"], "error: --epochs 0 is not allowed: must be a positive integer"),  # not local-epochs
        (["--repair-data", "pooled"], "--repair-data pooled needs --repair"),
        (["--bbp-sigma", "0"], "--bbp-sigma 0.0 is not allowed: must be a finite number > 0"),
        (["--bbp-estimate", "mode"], "--bbp-estimate 'mode' is not allowed: choose one of ['posterior', 'weighted']"),
        (["--otfusion-reg", "0"], "--otfusion-reg 0.0 is not allowed: must be > 0"),
        (["--widths", "0.5,x"], "--widths must be comma-separated numbers > 0"),
        (["--widths", "0.5", "--model", "resnet20"], "takes no width-factor"),
        (["--reference", "2"], "--reference must be a client index in [0, 2)"),
        (
            ["--costs", "weight", "--widths", "0.5,1"],
            "--costs weight cannot merge models of different widths (--widths 0.5,1 over 2 clients): only ot can",
        ),
        (["--costs", "ot", "bbp", "l1", "--widths", "1,0.5", "--clients", "3"], "--costs bbp l1 cannot merge"),
        (["--model", "psi-vgg9"], "--costs bbp (a default) is not allowed with --model psi-vgg9: BBP-MAP may widen"),
        (["--model", "psi-mobilenet", "--costs", "bbp"], "--costs bbp is not allowed with --model psi-mobilenet"),
    ],
)
def test_bad_options_stop_before_training_with_a_named_error(argv, fragment, tmp_path, capsys):
    assert main(["merge", *argv, "--out", str(tmp_path / "out")]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unknown_repair_data_is_refused_by_name_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["merge", "--repair", "--repair-data", "all", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "argument --repair-data: invalid choice: 'all' (choose from 'own', 'pooled')" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("given", "suffix"), [([], "+repair"), (["--repair-data", "pooled"], "+repair-pooled")])
def test_the_command_scores_every_merge_after_repair_on_the_data_asked_for(given, suffix, tmp_path):
    argv = ["merge", "--clients", "2", "--epochs", "1", "--costs", "weight", "--repair", *given]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "merge.json").read_text())
    assert payload["repair-data"] == ("pooled" if given else "own")
    assert set(payload["merged-accuracy"]) == {"average", "matched-weight", "ensemble"} | {
        f"average{suffix}",
        f"matched-weight{suffix}",
    }


def test_the_bbp_merge_reports_its_accuracy_and_global_widths(tmp_path, capsys):
    code = main(
        [
            "merge",
            "--clients",
            "3",
            "--epochs",
            "1",
            "--costs",
            "bbp",
            "weight",
            "--init",
            "different",
            "--bbp-include-classifier",
            "true",
            "--bbp-iterations",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    payload = json.loads((tmp_path / "merge.json").read_text())
    # every BBP-MAP setting is an option (declared once, in alignfl.core.merging.bbp.BBPSettings) and recorded
    assert payload["bbp"] == {**dataclasses.asdict(BBPSettings()), "include_classifier": True, "iterations": 2}
    assert {"matched-bbp", "matched-weight", "average", "ensemble"} <= set(payload["merged-accuracy"])
    widths = payload["bbp-global-width"]
    assert set(widths) == {"hidden.0", "hidden.1", "hidden.2", "hidden.3"}
    assert all(widths[g] >= w for g, w in zip(widths, (20, 100, 120, 84)))  # clients' small-mlp widths
    assert "global width per layer of matched-bbp" in capsys.readouterr().out


def test_ot_fusion_merges_a_permuted_copy_back_and_models_of_different_widths_into_the_references():
    digits, model, state, permuted = model_and_permuted_copy()
    clients, merged, _ = merge_accuracies(
        DIGITS_MLP, model, [state, permuted], [1.0, 2.0], digits.test_x, digits.test_y, ["ot"], 1, torch.device("cpu")
    )
    assert merged["matched-ot"] == merged["ensemble"] == clients[0]
    narrow = build_model("small-mlp", (1, 8, 8), 10, width_factor=0.5).state_dict()
    _, merged, widths = merge_accuracies(
        DIGITS_MLP,
        model,
        [narrow, state],
        [1.0, 1.0],
        digits.test_x,
        digits.test_y,
        ["ot", "l1"],
        1,
        torch.device("cpu"),
        reference=1,
    )
    assert set(merged) == {"matched-ot", "ensemble"}  # plain and one-to-one averages need equal widths
    assert widths == model.permutation_spec().group_sizes(state)


def test_the_costs_default_to_those_that_can_merge_the_clients_models():
    assert costs(None, (1.0,), 2, 0) == list(MERGE_COSTS)
    assert costs(None, (1.0,), 2, "universe") == list(UNIVERSE_COSTS)
    assert costs(None, (0.5, 1.0), 2, 0) == ["ot"]
    assert costs(["weight", "ot"], (0.5, 0.5), 3, 0) == ["weight", "ot"]
    assert costs(["weight"], (0.5, 1.0), 1, 0) == ["weight"]  # widths past the clients make no difference


def test_universe_matching_of_clients_of_different_widths_is_refused():
    with pytest.raises(AnalysisError, match="--reference universe cannot match models of different widths"):
        costs(None, (0.5, 1.0), 2, "universe")


def test_the_command_fuses_clients_of_different_widths_by_ot(tmp_path):
    argv = ["merge", "--clients", "2", "--epochs", "1", "--costs", "ot", "--widths", "0.5,1", "--reference", "1"]
    assert main([*argv, "--otfusion-exact", "false", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "merge.json").read_text())
    assert payload["widths"] == [0.5, 1.0] and payload["otfusion"]["exact"] is False
    assert set(payload["merged-accuracy"]) == {"matched-ot", "ensemble"}


@pytest.mark.parametrize(
    ("strategy", "keys"),
    [
        ("matched", {"matched-reference": "global"}),
        ("matched", {"matched-reference": "client"}),
        ("matched", {"matched-reference": "iterative", "matched-iterative-start": "client"}),
        ("otfusion", {}),
    ],
)
def test_an_alignment_that_moves_no_unit_merges_to_fedavgs_model_bit_for_bit(strategy, keys):
    """Clients a little apart from one start: every unit stays in place, so the aligned merge is FedAvg's to the
    last bit (the same arithmetic), not a model an ulp away that long local training would grow into points."""
    _, model, state, _ = model_and_permuted_copy()
    generator = torch.Generator().manual_seed(2)
    clients = [{k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in state.items()} for _ in range(5)]
    counts = [257.0, 1_031.0, 64.0, 3_999.0, 700.0]
    fedavg = strategy_merge(DIGITS_MLP, model, "fedavg", {}, clients, counts, state).arrays.to_torch_state_dict()
    aligned = strategy_merge(DIGITS_MLP, model, strategy, keys, clients, counts, state)
    moved = aligned.metrics.get("units-moved") or aligned.metrics["transport-off-diagonal"]
    assert max(moved.values()) < 1e-12, moved
    merged = aligned.arrays.to_torch_state_dict()
    assert all(torch.equal(merged[key], fedavg[key]) for key in fedavg), [
        key for key in fedavg if not torch.equal(merged[key], fedavg[key])
    ]
