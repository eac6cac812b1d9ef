"""transformer-1's permutation symmetry (pre- and post-LN) and the majority-tokens task it is meant for."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from alignfl.core.data import load_dataset, tokens
from alignfl.core.merging.alignment import find_permutations, list_costs
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import PanSettings, PermutationSpec, invert_permutations, permute_state, random_permutations
from alignfl.models.transformer import Transformer1, sinusoid_table

SHAPE = (1, tokens.LENGTH, tokens.VOCABULARY)


def _model(norm_first: bool, pan: PanSettings | None = None) -> Transformer1:
    """A small transformer with every LayerNorm entry made distinct, in eval mode."""
    torch.manual_seed(0)
    model = Transformer1(SHAPE, 5, width=12, head_width=6, hidden=20, norm_first=norm_first, pan=pan or PanSettings())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.3)
    return model.eval()


def _tokens(batch: int = 4) -> torch.Tensor:
    ids = torch.randint(0, tokens.VOCABULARY, (batch, tokens.LENGTH), generator=torch.Generator().manual_seed(1))
    return nn.functional.one_hot(ids, tokens.VOCABULARY).float().unsqueeze(1)


def _output(model: Transformer1, state: dict) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.no_grad():
        return model(_tokens())


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-ln", "post-ln"])
def test_permuting_every_group_keeps_the_function(norm_first):
    model = _model(norm_first)
    spec, state = model.permutation_spec(), dict(model.state_dict())
    before = _output(model, state)
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(2)))
    assert not torch.equal(permuted["positions"], state["positions"])
    torch.testing.assert_close(_output(model, permuted), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("group", "dropped"),
    [("attn.qk", "attn.key."), ("stream", "positions"), ("attn.v", "attn.out.weight")],
    ids=["q-without-k", "stream-without-positions", "v-without-out"],
)
def test_leaving_out_one_shared_axis_breaks_the_symmetry(group, dropped):
    """The spec's sharing is necessary: permuting a group without one of its axes changes the output."""
    model = _model(norm_first=True)
    spec, state = model.permutation_spec(), dict(model.state_dict())
    broken = PermutationSpec({group: tuple(r for r in spec.groups[group] if not r.key.startswith(dropped))})
    perm = torch.roll(torch.arange(broken.group_sizes(state)[group]), 1)
    before = _output(model, state)
    after = _output(model, permute_state(broken, state, {group: perm}))
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("cost", list_costs())
def test_post_ln_permuted_copy_is_aligned_back_exactly(cost):
    model = _model(norm_first=False)
    spec, state = model.permutation_spec(), dict(model.state_dict())
    applied = random_permutations(spec, state, torch.Generator().manual_seed(3))
    found = find_permutations(state, permute_state(spec, state, applied), spec, cost)
    expected = invert_permutations(applied)
    assert all(torch.equal(found[g], expected[g]) for g in spec.groups)


def test_pan_sits_on_the_mlp_hidden_units_and_breaks_their_symmetry():
    pan = PanSettings("mul", 1.0, 0.5)
    model = _model(norm_first=True, pan=pan)
    spec, state = model.permutation_spec(), dict(model.state_dict())
    assert model.mlp.pan.encoding.numel() == 20 and "mlp.pan.encoding" not in state
    before = _output(model, state)
    perm = {"mlp": torch.roll(torch.arange(20), 1)}
    assert (_output(model, permute_state(spec, state, perm)) - before).abs().max() > 1e-3


def test_positions_are_the_fixed_sinusoids():
    table = sinusoid_table(5, 6)
    assert torch.allclose(table[0], torch.tensor([0.0, 1.0] * 3))
    assert torch.allclose(table[3, 0], torch.sin(torch.tensor(3.0)))
    assert torch.allclose(table[3, 3], torch.cos(torch.tensor(3.0 / 10_000 ** (2 / 6))))
    assert not any(p is table for p in _model(True).parameters())  # a buffer, not trained


def test_majority_tokens_are_one_hot_with_a_unique_most_frequent_token():
    dataset = load_dataset("majority-tokens")
    assert dataset.input_shape == SHAPE and dataset.num_classes == tokens.VOCABULARY
    assert len(dataset.train_y) == tokens.TRAIN_SIZE and len(dataset.test_y) == tokens.TEST_SIZE
    x = dataset.train_x[:500, 0]
    assert torch.equal(x.sum(dim=2), torch.ones(500, tokens.LENGTH))
    counts = x.sum(dim=1)
    top = counts.max(dim=1)
    assert torch.equal(top.indices, dataset.train_y[:500])
    assert torch.all((counts == top.values[:, None]).sum(dim=1) == 1)
    again = tokens.majority_tokens()
    assert torch.equal(again[0], dataset.train_x) and torch.equal(again[3], dataset.test_y)
    assert torch.bincount(dataset.train_y).min() > 0.8 * tokens.TRAIN_SIZE / tokens.VOCABULARY


@pytest.mark.slow  # ~15 s on two loaded cores
def test_matched_transformer_on_majority_tokens_learns(tmp_path):
    config = {
        "strategy": "matched",
        "model": "transformer-1",
        "dataset": "majority-tokens",
        "matched-cost": "l1",
        "num-server-rounds": 2,
        "results-dir": str(tmp_path),
        "device": "cpu",
    }
    run_in_process(config, num_nodes=3)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1
