"""Tests for alignfl/models/: registry, shapes, permutation symmetry and position-aware neurons."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from model_checks import randomise
from torch import nn

import alignfl.models.registry as registry
from alignfl.models import (
    AxisRef,
    PanSettings,
    Permutable,
    PermutationSpec,
    PositionEncoding,
    build_model,
    identity_permutations,
    invert_permutations,
    list_models,
    permute_state,
    random_permutations,
    unit_view,
)

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
ALL_MODELS = list_models()
PAN_ON = PanSettings(mode="mul", period=1.0, amplitude=0.5)


def _inputs(shape: tuple[int, int, int], batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))


def _randomised_model(name: str, shape: tuple[int, int, int], num_classes: int, pan: PanSettings | None = None):
    """A model with every entry distinct (:func:`model_checks.randomise`)."""
    torch.manual_seed(1)
    return randomise(build_model(name, shape, num_classes, pan))


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _tolerance(reference: torch.Tensor) -> float:
    """Float-noise allowance relative to the output scale (random-init outputs can be ~1e-2)."""
    return 1e-4 * reference.abs().max().item() + 1e-7


def _output_after(name, shape, num_classes, pan, state) -> torch.Tensor:
    """Load ``state`` into a fresh model of the same kind and run it on the standard input."""
    fresh = build_model(name, shape, num_classes, pan)
    fresh.load_state_dict(state)
    return _forward(fresh.eval(), _inputs(shape))


# --- registry -------------------------------------------------------------------------


def test_registry_lists_every_network():
    assert (
        sorted(
            [
                "mlp",
                "small-mlp",
                "twonn",
                "twocnn",
                "vgg9",
                "vgg9-bn",
                "vgg9-gn",
                "vgg11",
                "resnet20",
                "transformer-1",
                "psi-vgg9",
                "psi-vgg11",
                "mobilenet",
                "psi-mobilenet",
            ]
        )
        == ALL_MODELS
    )


def test_unknown_model_name_lists_allowed_names():
    with pytest.raises(ValueError) as excinfo:
        build_model("vgg99", (1, 8, 8), 10)
    message = str(excinfo.value)
    assert "'vgg99'" in message
    assert all(name in message for name in ALL_MODELS)


@pytest.mark.parametrize("shape", [(1, 8), (0, 8, 8), (1, 8.0, 8), (1, -2, 8), "1x8x8", (True, 8, 8)])
def test_bad_input_shape_is_rejected(shape):
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", shape, 10)


@pytest.mark.parametrize("num_classes", [1, 0, 2.5, True])
def test_bad_num_classes_is_rejected(num_classes):
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (1, 8, 8), num_classes)


def test_registering_a_taken_name_fails(monkeypatch):
    monkeypatch.setattr(registry.MODELS, "_entries", dict(registry.MODELS._entries))
    with pytest.raises(ValueError, match="already registered"):
        registry.MODELS.register(registry.Model("mlp", lambda shape, classes, pan: nn.Identity()))


# --- shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_forward_shape(name, shape):
    model = build_model(name, shape, 7)
    out = model(_inputs(shape))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("pan", [None, PAN_ON], ids=["pan-off", "pan-on"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_classifier_of_representation_is_the_forward_pass(name, pan):
    """MOON contrasts ``representation(x)``: it must be exactly what the classifier reads."""
    shape = (1, 8, 8)
    model = _randomised_model(name, shape, 5, pan)
    x = _inputs(shape)
    with torch.no_grad():
        features = model.representation(x)
        assert features.shape == (2, model.classifier.in_features)
        torch.testing.assert_close(model.classifier(features), model(x), rtol=0.0, atol=0.0)


def test_vgg9_flatten_matches_paper_on_cifar():
    model = build_model("vgg9", (3, 32, 32), 10)
    assert model.state_dict()["fcs.0.weight"].shape == (512, 4096)


@pytest.mark.parametrize(
    ("name", "norm", "entries"), [("vgg9", None, 0), ("vgg9-bn", nn.BatchNorm2d, 4), ("vgg9-gn", nn.GroupNorm, 2)]
)
def test_vgg9_norm_variants_sit_after_every_conv_and_move_with_its_channels(name, norm, entries):
    model = build_model(name, (1, 28, 28), 10)
    norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert len(norms) == (6 if norm else 0) and all(type(m) is norm for m in norms)
    if norm is nn.GroupNorm:
        assert all(m.num_groups == 1 for m in norms)
    refs = {ref.key for ref in model.permutation_spec().groups["convs.2"]}
    assert len({key for key in refs if key.startswith("norms.2.")}) == entries
    plain = build_model("vgg9", (1, 28, 28), 10).state_dict()
    assert {k: v.shape for k, v in plain.items()} == {
        k: v.shape for k, v in model.state_dict().items() if not k.startswith("norms.")
    }


def test_width_factor_scales_every_hidden_layer():
    model = build_model("vgg9-bn", (1, 28, 28), 10, width_factor=0.25)
    assert [conv.out_channels for conv in model.convs] == [8, 16, 32, 32, 64, 64]
    assert [fc.out_features for fc in model.fcs] == [128, 128]
    assert model.norms[5].num_features == 64
    assert [conv.out_channels for conv in build_model("vgg11", (1, 8, 8), 10, width_factor=0.001).convs] == [1] * 8
    psi = build_model("psi-vgg9", (1, 28, 28), 10, width_factor=0.5)  # 128 * 0.5 = 64 -> 7 per group
    assert psi.convs[1].out_channels == 32 and psi.convs[2].groups[0].out_channels == 7
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="width-factor"):
            build_model("vgg9", (1, 8, 8), 10, width_factor=bad)


def test_vgg11_skips_pools_that_would_empty_the_map():
    # one flag per conv; VGG-11 asks for a pool after convs 0, 1, 3, 5 and 7: 8 -> 4 -> 2 -> 1, then skipped
    assert build_model("vgg11", (1, 8, 8), 10).pool_after == (True, True, False, True, False, False, False, False)
    assert build_model("vgg11", (1, 28, 28), 10).spatial == 1


def test_resnet20_layout():
    model = build_model("resnet20", (3, 32, 32), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 1 + 18 + 2  # stem, two per block, two conv shortcuts
    assert [b.has_conv_shortcut for b in model.blocks] == [False] * 3 + [True, False, False] * 2
    assert model.classifier.in_features == 256


# --- permutation spec -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_spec_covers_every_hidden_unit_and_no_io_axis(name, shape):
    model = build_model(name, shape, 5)
    assert isinstance(model, Permutable)
    spec = model.permutation_spec()
    state = model.state_dict()
    sizes = spec.group_sizes(state)  # raises if a key is missing or sizes disagree
    assert all(n > 1 for n in sizes.values())

    float_keys = {k for k, v in state.items() if torch.is_floating_point(v)}
    classifier_biases = {k for k in float_keys if k.startswith("classifier.") and k.endswith("bias")}
    assert classifier_biases and float_keys - set(spec.axes_by_key()) == classifier_biases  # Ψ-Net: one per head

    first_weight = next(k for k in state if k.endswith("weight"))
    refs = {(ref.key, ref.axis) for group in spec.groups.values() for ref in group}
    assert (first_weight, 1) not in refs
    assert not any(key.startswith("classifier.") and axis == 0 for key, axis in refs)
    assert (first_weight, 0) in {(r.key, r.axis) for r in next(iter(spec.groups.values()))}


def test_group_order_runs_from_input_to_output():
    def order(name):
        return list(build_model(name, (1, 8, 8), 3).permutation_spec().groups)

    assert order("mlp") == ["hidden.0", "hidden.1", "hidden.2"]
    assert order("vgg9") == [f"convs.{i}" for i in range(6)] + ["fcs.0", "fcs.1"]
    blocks = [f"blocks.{i}.conv1" for i in range(9)]
    expected = ["stream.0", *blocks[:4], "stream.1", *blocks[4:7], "stream.2", *blocks[7:]]
    assert order("resnet20") == expected


def test_resnet_stream_groups_share_the_residual_path():
    spec = build_model("resnet20", (3, 32, 32), 10).permutation_spec()
    stream0 = {(r.key, r.axis) for r in spec.groups["stream.0"]}
    for i in range(3):
        assert {(f"blocks.{i}.bn2.running_var", 0), (f"blocks.{i}.conv1.weight", 1)} <= stream0
    assert ("blocks.3.shortcut.conv.weight", 1) in stream0
    assert ("blocks.3.shortcut.bn.weight", 0) in {(r.key, r.axis) for r in spec.groups["stream.1"]}
    assert all("num_batches_tracked" not in key for key in spec.axes_by_key())


def test_flattened_channel_owns_a_block_of_columns():
    model = build_model("twocnn", (1, 28, 28), 10)  # 64 channels of 7x7 before the flatten
    ref = next(r for r in model.permutation_spec().groups["convs.1"] if r.key == "fcs.0.weight")
    assert ref == AxisRef("fcs.0.weight", 1, 49)
    weight = model.state_dict()["fcs.0.weight"]
    rows = unit_view(weight, ref)
    assert rows.shape == (64, 512 * 49)
    assert torch.equal(rows[3], weight[:, 3 * 49 : 4 * 49].flatten())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_random_permutation_preserves_function(name, shape):
    model = _randomised_model(name, shape, 3)
    state = model.state_dict()
    perms = random_permutations(model.permutation_spec(), state, torch.Generator().manual_seed(2))
    permuted = permute_state(model.permutation_spec(), state, perms)
    assert any(not torch.equal(permuted[k], state[k]) for k in state)

    before = _forward(model, _inputs(shape))
    after = _output_after(name, shape, 3, None, permuted)
    torch.testing.assert_close(after, before, rtol=0, atol=_tolerance(before))


@pytest.mark.parametrize("name", ALL_MODELS)
def test_permuting_only_outgoing_side_changes_output(name):
    """The invariance test can fail: a group permuted on its producer only is not a symmetry."""
    shape = (1, 8, 8)
    model = _randomised_model(name, shape, 3)
    state = model.state_dict()
    group, refs = next(iter(model.permutation_spec().groups.items()))
    broken = PermutationSpec({group: tuple(r for r in refs if r.axis == 0)})
    size = broken.group_sizes(state)[group]
    perm = torch.roll(torch.arange(size), 1)
    before = _forward(model, _inputs(shape))
    after = _output_after(name, shape, 3, None, permute_state(broken, state, {group: perm}))
    assert (after - before).abs().max() > 10 * _tolerance(before)


@pytest.mark.parametrize("name", ["small-mlp", "resnet20"])
def test_inverse_permutation_restores_state_exactly(name):
    model = build_model(name, (1, 8, 8), 4)
    spec, state = model.permutation_spec(), model.state_dict()
    perms = random_permutations(spec, state, torch.Generator().manual_seed(3))
    restored = permute_state(spec, permute_state(spec, state, perms), invert_permutations(perms))
    assert restored.keys() == state.keys()
    assert all(torch.equal(restored[k], state[k]) for k in state)
    identity = permute_state(spec, state, identity_permutations(spec, state))
    assert all(torch.equal(identity[k], state[k]) and identity[k] is not state[k] for k in state)


def test_permute_state_rejects_bad_permutations():
    model = build_model("small-mlp", (1, 8, 8), 4)
    spec, state = model.permutation_spec(), model.state_dict()
    with pytest.raises(ValueError, match="unknown permutation groups"):
        permute_state(spec, state, {"nope": torch.arange(3)})
    with pytest.raises(ValueError, match="hidden.0"):
        permute_state(spec, state, {"hidden.0": torch.arange(19)})
    with pytest.raises(ValueError, match="hidden.0"):
        permute_state(spec, state, {"hidden.0": torch.zeros(20, dtype=torch.long)})


def test_spec_rejects_an_axis_claimed_twice():
    with pytest.raises(ValueError, match="claimed by groups"):
        PermutationSpec({"a": (("w", 0),), "b": (("w", 0),)})


def test_model_survives_deepcopy_and_pickle():
    model = build_model("resnet20", (1, 8, 8), 3, PAN_ON)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.permutation_spec() == model.permutation_spec()
        assert torch.equal(clone.blocks[0].pan1.encoding, model.blocks[0].pan1.encoding)


# --- position-aware neurons -----------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [PanSettings("off", 1.0, 0.5), PanSettings("mul", 1.0, 0.0), PanSettings("add", 0.0, 0.25)],
    ids=["off", "A=0", "T=0"],
)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_inactive_pan_is_exactly_a_plain_model(name, settings):
    shape = (1, 8, 8)
    plain = _randomised_model(name, shape, 3)
    pan_model = build_model(name, shape, 3, settings).eval()
    pan_model.load_state_dict(plain.state_dict())
    assert torch.equal(_forward(pan_model, _inputs(shape)), _forward(plain, _inputs(shape)))


@pytest.mark.parametrize("name", ALL_MODELS)
def test_active_pan_breaks_permutation_invariance(name):
    shape = (1, 8, 8)
    model = _randomised_model(name, shape, 3, PAN_ON)
    state = model.state_dict()
    perms = random_permutations(model.permutation_spec(), state, torch.Generator().manual_seed(2))
    before = _forward(model, _inputs(shape))
    after = _output_after(name, shape, 3, PAN_ON, permute_state(model.permutation_spec(), state, perms))
    assert (after - before).abs().max() > 10 * _tolerance(before)
    plain = _output_after(name, shape, 3, None, state)
    assert (plain - before).abs().max() > 10 * _tolerance(before)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_pan_encodings_are_buffers_outside_the_state_dict(name):
    pan_model = build_model(name, (1, 8, 8), 3, PAN_ON)
    plain = build_model(name, (1, 8, 8), 3)
    assert pan_model.state_dict().keys() == plain.state_dict().keys()
    assert not any("encoding" in key for key in pan_model.state_dict())
    encodings = [b for key, b in pan_model.named_buffers() if key.endswith("encoding")]
    assert encodings and not any(b.requires_grad for b in encodings)
    count = sum(p.numel() for p in pan_model.parameters())
    assert count == sum(p.numel() for p in plain.parameters())


def test_pan_sits_on_hidden_layers_only():
    mlp = build_model("mlp", (1, 28, 28), 10, PAN_ON)
    assert [pan.encoding.numel() for pan in mlp.pans] == [1024, 1024, 1024]
    resnet = build_model("resnet20", (3, 32, 32), 10, PAN_ON)
    pans = [m for m in resnet.modules() if isinstance(m, PositionEncoding)]
    assert len(pans) == 1 + 2 * 9 + 2  # stem, both convs of each block, two conv shortcuts


def test_encoding_matches_formula():
    settings = PanSettings("add", period=2.0, amplitude=0.3)
    layer = PositionEncoding(6, settings)
    expected = torch.tensor([0.3 * math.sin(2 * math.pi * 2.0 * j / 6) for j in range(6)])
    torch.testing.assert_close(layer.encoding, expected)
    quarter = PositionEncoding(4, PanSettings("add", 1.0, 0.5)).encoding
    torch.testing.assert_close(quarter, torch.tensor([0.0, 0.5, 0.0, -0.5]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("mode", ["add", "mul"])
@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 3, 3)])
def test_encoding_broadcasts_over_units(mode, shape):
    layer = PositionEncoding(6, PanSettings(mode, 1.0, 0.4))
    h = torch.randn(shape)
    e = layer.encoding.view((1, 6) + (1,) * (len(shape) - 2))
    torch.testing.assert_close(layer(h), h + e if mode == "add" else h * (1 + e))


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("mode", {"mode": "both"}),
        ("amplitude", {"amplitude": -0.1}),
        ("amplitude", {"amplitude": float("nan")}),
        ("period", {"period": -1.0}),
        ("period", {"period": "1"}),
    ],
)
def test_bad_pan_settings_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"PanSettings.{field}"):
        PanSettings(**kwargs)


# --- run-config weight init -----------------------------------------------------------


def test_he_init_redraws_every_layer_and_default_keeps_the_builders():
    from alignfl.core.data import load_dataset
    from alignfl.core.model_io import build_run_model
    from alignfl.fl_app.config import ConfigError, parse_run_config

    digits = load_dataset("digits")

    def built(init: str) -> nn.Module:
        torch.manual_seed(0)
        return build_run_model(parse_run_config({"dataset": "digits", "model": "vgg9", "init": init}), digits)

    torch.manual_seed(0)
    as_built = build_model("vgg9", digits.input_shape, digits.num_classes)
    default, he = built("default"), built("he")
    assert all(torch.equal(a, b) for a, b in zip(as_built.state_dict().values(), default.state_dict().values()))
    layers = [m for m in he.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(layers) == 9 and all(not m.bias.any() for m in layers)
    conv = he.convs[3].weight  # fan-in 64 * 9: He std sqrt(2 / 576) = 0.059; PyTorch's default gives 0.024
    assert abs(conv.std().item() - math.sqrt(2 / conv[0].numel())) < 0.005
    with pytest.raises(ConfigError, match="'init' = 'xavier'"):
        parse_run_config({"init": "xavier"})
