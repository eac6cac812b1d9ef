"""MobileNetV1 and its Ψ-Net form (alignfl/models/mobilenet.py): shapes, permutation symmetry, PANs, group isolation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_checks import randomise
from torch import nn

from alignfl.models import (
    PanSettings,
    PermutationSpec,
    PositionEncoding,
    build_model,
    permute_state,
    random_permutations,
)
from alignfl.models.mobilenet import GroupedDepthwise, PsiMobileNet, stride_plan
from alignfl.models.psinet import GroupedConv2d, GroupedNorm, group_layout

SHAPES = [(1, 28, 28), (3, 32, 32)]
NARROW = {"width_factor": 0.25}  # widths 8 ... 256: fast on a 2-core CPU
PAN_ON = PanSettings(mode="mul", period=1.0, amplitude=0.5)
VARIANTS = [
    ("mobilenet", {}),
    ("psi-mobilenet", {"psi_groups": 3, "psi_depth": 0}),
    ("psi-mobilenet", {"psi_groups": 3, "psi_depth": 5}),
    ("psi-mobilenet", {"psi_groups": 4, "psi_depth": 13}),
]
VARIANT_IDS = ["plain", "psi-depth0", "psi-depth5", "psi-depth13"]


def _inputs(shape: tuple[int, int, int], batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))


def _build(
    name: str, shape: tuple[int, int, int], num_classes: int, pan: PanSettings | None = None, **options: Any
) -> nn.Module:
    torch.manual_seed(1)
    return build_model(name, shape, num_classes, pan, **NARROW, **options)


def _output(model: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.no_grad():
        return model(x)


# --- shapes and structure -------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_output_and_representation_shapes(name, options, shape):
    model = _build(name, shape, 10, **options)
    x = _inputs(shape)
    out, features = model(x), model.representation(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert features.shape == (2, model.classifier.in_features)
    torch.testing.assert_close(model.classifier(features), out, rtol=0.0, atol=0.0)


def test_strides_keep_small_maps_at_least_two_pixels_wide():
    # four halvings: 28 -> 14 -> 7 -> 4 -> 2 and 32 -> 16 -> 8 -> 4 -> 2; on 8x8 the last two are skipped
    full = (1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1)
    assert stride_plan(28, 28) == stride_plan(32, 32) == full
    assert stride_plan(8, 8) == (1, 2, 1, 2) + (1,) * 9
    assert stride_plan(1, 1) == (1,) * 13


def test_layers_follow_howard_et_al():
    model = build_model("mobilenet", (3, 32, 32), 10)
    assert model.stem.conv.out_channels == 32 and model.stem.conv.stride == (1, 1)
    assert [block.pw.conv.out_channels for block in model.blocks] == [64, 128, 128, 256, 256] + [512] * 6 + [1024] * 2
    assert all(
        block.dw.conv.groups == block.dw.conv.in_channels == block.dw.conv.out_channels for block in model.blocks
    )
    assert all(
        isinstance(block.dw.norm, nn.BatchNorm2d) and block.pw.conv.kernel_size == (1, 1) for block in model.blocks
    )
    assert model.classifier.in_features == 1024
    assert sum(p.numel() for p in model.parameters()) == 3_217_226  # ~3.2 M, as in the paper at width 1
    narrow = build_model("mobilenet", (1, 28, 28), 10, width_factor=0.25)
    assert narrow.stem.conv.out_channels == 8 and narrow.classifier.in_features == 256


def test_psi_structure_shared_below_depth_grouped_from_it():
    model = _build("psi-mobilenet", (1, 28, 28), 10, psi_groups=3, psi_depth=2)
    shared, branch, grouped = model.blocks[1], model.blocks[2], model.blocks[3]
    assert isinstance(shared.pw.norm, nn.BatchNorm2d) and isinstance(shared.pw.conv, nn.Conv2d)
    # the first grouped block filters the shared channels (shared depthwise), then branches
    assert isinstance(branch.dw.conv, nn.Conv2d) and isinstance(branch.dw.norm, nn.BatchNorm2d)
    assert isinstance(branch.pw.conv, GroupedConv2d) and branch.pw.conv.branching
    assert branch.pw.conv.groups[0].weight.shape == (11, 32, 1, 1)  # 128 * 0.25 = 32 -> 3 x ceil(32 / 3)
    assert isinstance(grouped.dw.conv, GroupedDepthwise) and isinstance(grouped.dw.norm, GroupedNorm)
    assert grouped.dw.conv.groups[0].weight.shape == (11, 1, 3, 3)
    assert grouped.pw.conv.groups[0].weight.shape == (22, 11, 1, 1) and not grouped.pw.conv.branching
    assert [head.out_features for head in model.classifier.groups] == [4, 3, 3]
    assert model.class_groups == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert build_model("psi-mobilenet", (1, 28, 28), 10, **NARROW).num_groups == 10  # psi-groups 0: one per class


def test_psi_depth_out_of_range_names_the_key():
    with pytest.raises(ValueError, match=r"psi-depth must be an int in \[0, 13\]"):
        PsiMobileNet((1, 28, 28), 10, (8,) * 14, PanSettings(), 0, 14)


def test_layout_splits_every_federated_key_once():
    model = _build("psi-mobilenet", (1, 28, 28), 6, psi_groups=3, psi_depth=4)
    layout = model.layout()
    keys = [k for k, v in model.state_dict().items() if torch.is_floating_point(v)]
    grouped = [key for group in layout.groups for key in group]
    assert set(layout.shared) | set(grouped) == set(keys) and len(layout.shared) + len(grouped) == len(keys)
    assert {"stem.conv.weight", "blocks.3.pw.norm.running_var", "blocks.4.dw.conv.weight"} <= set(layout.shared)
    assert {"blocks.4.pw.conv.groups.1.weight", "blocks.5.dw.norm.groups.1.bias", "classifier.groups.1.bias"} <= set(
        layout.groups[1]
    )
    assert layout == group_layout(keys)  # what the server reads from key names alone


# --- permutation symmetry -------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
def test_random_permutation_preserves_function(name, options, shape):
    model = randomise(_build(name, shape, 6, **options))
    spec, state = model.permutation_spec(), model.state_dict()
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(2)))
    assert any(not torch.equal(permuted[k], state[k]) for k in state)
    float_keys = {k for k, v in state.items() if torch.is_floating_point(v)}
    assert float_keys - set(spec.axes_by_key()) == {
        k for k in float_keys if k.startswith("classifier.") and k.endswith(".bias")
    }
    x = _inputs(shape)
    before = _output(model, state, x)
    after = _output(model, permuted, x)
    torch.testing.assert_close(after, before, rtol=0.0, atol=1e-4 * before.abs().max().item() + 1e-6)


def test_depthwise_channels_belong_to_the_group_that_feeds_them():
    spec = _build("mobilenet", (1, 28, 28), 10).permutation_spec()
    assert list(spec.groups) == ["stem"] + [f"blocks.{i}.pw" for i in range(13)]
    axes = {(r.key, r.axis) for r in spec.groups["blocks.0.pw"]}
    assert {
        ("blocks.0.pw.conv.weight", 0),
        ("blocks.0.pw.norm.running_mean", 0),
        ("blocks.1.dw.conv.weight", 0),
        ("blocks.1.dw.norm.weight", 0),
        ("blocks.1.pw.conv.weight", 1),
    } <= axes
    assert ("classifier.weight", 1) in {(r.key, r.axis) for r in spec.groups["blocks.12.pw"]}


def test_permuting_a_group_without_its_depthwise_conv_changes_the_function():
    """The tie is needed: moving a pointwise conv's outputs but not the next depthwise conv breaks the net."""
    model = randomise(_build("mobilenet", (1, 28, 28), 6))
    state, refs = model.state_dict(), model.permutation_spec().groups["blocks.3.pw"]
    untied = PermutationSpec({"g": tuple(r for r in refs if not r.key.startswith("blocks.4.dw."))})
    perm = torch.roll(torch.arange(untied.group_sizes(state)["g"]), 1)
    x = _inputs((1, 28, 28))
    before = _output(model, state, x)
    after = _output(model, permute_state(untied, state, {"g": perm}), x)
    assert (after - before).abs().max() > 1e-2 * before.abs().max()


def test_psi_permutations_stay_inside_groups():
    model = _build("psi-mobilenet", (1, 28, 28), 6, psi_groups=3, psi_depth=4)
    layout = model.layout()
    for name, refs in model.permutation_spec().groups.items():
        owners = {g for ref in refs for g, keys in enumerate(layout.groups) if ref.key in keys}
        if ".groups." in name:
            assert len(owners) == 1 and name.endswith(f".groups.{owners.pop()}")
        else:  # shared units reach the groups only as inputs of the branching pointwise conv
            assert all(ref.axis == 1 for ref in refs if ref.key not in layout.shared)


# --- position-aware neurons -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "first_widths"), [(*VARIANTS[0], [8, 8, 16]), (*VARIANTS[1], [8, 8, 18])], ids=VARIANT_IDS[:2]
)
def test_pans_sit_on_every_hidden_conv_and_change_the_output(name, options, first_widths):
    shape = (1, 28, 28)
    plain = randomise(_build(name, shape, 6, **options))
    pan_model = _build(name, shape, 6, PAN_ON, **options).eval()
    pans = [m for m in pan_model.modules() if isinstance(m, PositionEncoding)]
    assert len(pans) == 1 + 2 * 13  # stem, and both convs of every block
    assert [pan.encoding.numel() for pan in pans[:3]] == first_widths  # stem, depthwise, pointwise (3 x 6 grouped)
    assert pan_model.state_dict().keys() == plain.state_dict().keys()
    x = _inputs(shape)
    with torch.no_grad():
        reference = plain(x)
        pan_out = _output(pan_model, plain.state_dict(), x)
    assert (pan_out - reference).abs().max() > 1e-2 * reference.abs().max()
    off = _build(name, shape, 6, PanSettings("mul", 1.0, 0.0), **options).eval()
    assert torch.equal(_output(off, plain.state_dict(), x), reference)


# --- gradient isolation ---------------------------------------------------------------


def _largest_grad_per_group(model: PsiMobileNet) -> tuple[float, dict[int, float]]:
    """Largest |gradient| over the shared parameters, and over each group's."""
    params = dict(model.named_parameters())
    layout = model.layout()

    def largest(keys):
        grads = [params[k].grad for k in keys if k in params and params[k].grad is not None]
        return max((grad.abs().max().item() for grad in grads), default=0.0)

    return largest(layout.shared), {g: largest(keys) for g, keys in enumerate(layout.groups)}


@pytest.mark.parametrize("pan", [None, PAN_ON], ids=["pan-off", "pan-on"])
@pytest.mark.parametrize(("groups", "depth"), [(10, 2), (3, 0), (4, 13)])
def test_class_loss_gradient_reaches_only_its_group(groups, depth, pan):
    model = _build("psi-mobilenet", (1, 28, 28), 10, pan, psi_groups=groups, psi_depth=depth)
    x = _inputs((1, 28, 28), batch=4)
    for label in (0, 9):
        model.zero_grad(set_to_none=True)
        model(x)[:, label].sum().backward()  # class c's confidence Z_c, as in Fed2's Eq. 2
        shared, per_group = _largest_grad_per_group(model)
        mine = model.class_groups[label]
        assert shared > 0 and per_group[mine] > 0
        assert all(value == 0.0 for g, value in per_group.items() if g != mine), per_group
